"""Per-process memory of a run under torchrun, from the single-device plan of its share.

The planner follows one process's step on fake tensors (its micro-batches: the activations are
those of one device); this turns that plan into what each process holds:

- FSDP: parameters, gradients and optimizer states are sharded (`fully_shard` cuts each
  parameter along dim 0 into `world_size` pieces, the first ones ceil(rows / N) rows: rank 0
  holds the most, and that is what is reported). On top of the shards: the parameters gathered
  for computing: the root's (embeddings, final norm, output layer: kept from forward to
  backward) and, per block, the one being computed and the next one being prefetched (with
  `reshard_after_forward false`, every block stays gathered from its forward to its backward),
  in the gathered dtype (bf16 under FSDP's mixed precision), plus, in backward, one block's
  full gradient before its reduce-scatter and the root's full gradient (reduced when backward
  ends). A peak in forward outside the blocks (the loss, as a GPT's forward peak usually is)
  holds no block gathered: each was resharded after its forward. With `cpu_offload`, shards
  live in host memory.
- DDP: every process holds everything (gradients are views into DDP's buckets: no second copy).

A prediction, labelled as one: the communication buffers of NCCL and the CUDA context are not
counted (plan.py keeps 0.5 GiB for the context, as on one GPU).
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class ParamShape:
    shape: tuple[int, ...]
    element_size: int

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    def shard_numel(self, world_size: int) -> int:
        """Rank 0's piece of dim 0 (FSDP2 / torch.chunk: ceil(rows / N) rows)."""
        if not self.shape:
            return 1
        rows = self.shape[0]
        return min(rows, -(-rows // world_size)) * (self.numel // rows if rows else 0)


def shard_fraction(params: list[ParamShape], world_size: int) -> float:
    """Rank 0's share of the parameter bytes (about 1/N; more when rows do not divide)."""
    full = sum(p.numel * p.element_size for p in params)
    mine = sum(p.shard_numel(world_size) * p.element_size for p in params)
    return mine / full if full else 1.0


def per_rank_memory(
    single: dict[str, int],
    params: list[ParamShape],
    block_numels: list[int],
    *,
    world_size: int,
    strategy: str,
    reshard_after_forward: bool = True,
    cpu_offload: bool = False,
    gather_bytes: int = 4,
    reduce_bytes: int = 4,
    peak_in_backward: bool = True,
    peak_in_a_block: bool = True,
) -> dict[str, int]:
    """What rank 0 holds at its step's peak, from the single-device plan `single` of one
    process's share (the measured breakdown's names; `gathered` and `host` added)."""
    if strategy != "fsdp" or world_size < 1:
        return {**single, "gathered": 0, "host": single.get("host", 0)}
    r = shard_fraction(params, world_size)
    sharded = {g: int(single[g] * r) for g in ("params", "grads", "optimizer")}
    total_numel = sum(p.numel for p in params)
    root = total_numel - sum(block_numels)
    largest = max(block_numels, default=0)
    if not reshard_after_forward:
        blocks_gathered = sum(block_numels)
    elif peak_in_backward or peak_in_a_block:
        blocks_gathered = 2 * largest  # the one computing and the next, prefetched
    else:
        blocks_gathered = 0
    gathered = (root + blocks_gathered) * gather_bytes
    if peak_in_backward:
        # a block's full gradient before its reduce-scatter, and the root's: it reduces once,
        # when backward ends (its inputs are token ids, no gradient flows past it)
        gathered += largest * reduce_bytes + root * gather_bytes
    if world_size == 1 and not cpu_offload:
        gathered = 0  # one process: FSDP's "shards" are the whole parameters, nothing gathered
    # on the host, every shard's gradient exists by the end of backward, whenever the
    # device's peak comes: as many bytes as the shards of the weights
    host = 2 * sharded["params"] + sharded["optimizer"] if cpu_offload else 0
    host += single.get("host", 0)  # offloaded activations (and a host optimizer's bytes)
    device_states = {g: 0 for g in sharded} if cpu_offload else sharded
    out = {
        **device_states,
        "activations": single["activations"],
        "other": single["other"],
        "gathered": gathered,
        "host": host,
    }
    out["peak"] = sum(v for k, v in out.items() if k != "host")
    return out
