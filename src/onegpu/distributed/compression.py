"""Compressed gradient all-reduce for DDP, through PyTorch's own communication hooks.

- `bf16` / `fp16`: each gradient bucket is cast to 16 bits for the all-reduce and back
  (`default_hooks.bf16_compress_hook` / `fp16_compress_hook`): half the bytes, the rounding of
  a 16-bit sum.
- `powersgd:RANK` (Vogels et al., "PowerSGD: Practical Low-Rank Gradient Compression", 2019;
  `powerSGD_hook`): each gradient matrix n x m is sent as two rank-RANK factors, (n + m) x RANK
  numbers, with error feedback (what compression lost is added to the next step's gradient)
  and warm start (last step's factors start this step's). Vectors (biases, norms) and matrices
  too small to gain are all-reduced as they are. The first two steps run the plain all-reduce
  (PowerSGD's own start-up, `start_powerSGD_iter`). The hook's state (error feedback, warm-start factors, random
  generator, step count) lives on each process and is saved with every checkpoint, and every
  run cuts DDP's buckets alike, so a resumed run continues the same compression exactly.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

POWERSGD_MIN_COMPRESSION_RATE = 2  # PowerSGD compresses a matrix only where it gains this much
POWERSGD_START_ITER = 2  # steps of plain all-reduce first, as PowerSGD starts (its minimum)


def parse(spec: str) -> tuple[str, int]:
    """'powersgd:4' -> ('powersgd', 4); 'bf16' -> ('bf16', 0)."""
    kind, _, rank = spec.partition(":")
    return kind, int(rank or 0)


def register(ddp: nn.Module, spec: str) -> Any:
    """Install the hook `spec` names on a DDP module; the state to checkpoint (PowerSGD's) or
    None."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    kind, rank = parse(spec)
    if kind == "none":
        return None
    if kind == "fp16":
        ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)
        return None
    if kind == "bf16":
        ddp.register_comm_hook(None, bf16_allreduce_hook)
        return None
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook

    state = powerSGD_hook.PowerSGDState(
        process_group=None,
        matrix_approximation_rank=rank,
        start_powerSGD_iter=POWERSGD_START_ITER,
        min_compression_rate=POWERSGD_MIN_COMPRESSION_RATE,
        use_error_feedback=True,
        warm_start=True,
    )
    # PowerSGD keeps its error feedback and warm-start factors per bucket, laid out as the
    # bucket is; DDP re-cuts its buckets after a run's first step, in the order gradients came,
    # so a resumed run's first step would see other buckets than the saved state. Cut once,
    # from the parameters' own order, before the first step: every run has the same buckets.
    ddp.reducer._push_all_rebuilt_params()
    ddp.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
    return state


def bucket_cap_mb(spec: str, backend: str) -> float | None:
    """DDP's bucket size: one bucket for PowerSGD on gloo, whose chained all-reduces of two
    buckets at once can reach the processes in different orders (a collective mismatch that
    gloo aborts on); None (DDP's 25 MB) otherwise."""
    return 1e9 if parse(spec)[0] == "powersgd" and backend == "gloo" else None


def bf16_allreduce_hook(group, bucket):  # unannotated: DDP checks hooks' annotations
    """torch's bf16 compression (`default_hooks._compress_hook`) under a name DDP lets gloo
    run: its own `bf16_compress_hook` is refused off NCCL, though gloo sums bf16 too."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    return default_hooks._compress_hook(torch.bfloat16, group, bucket)


def state_dict(state: Any) -> dict[str, Any] | None:
    """PowerSGD's state without its process group, tensors on the host, its numpy generator
    (which draws the factors' starting values) as tensors and numbers: a checkpoint holds
    nothing else (it is loaded with weights_only)."""
    if state is None:
        return None
    saved = {k: _moved(getattr(state, k), "cpu") for k in state.__slots__ if k != "process_group"}
    _, keys, pos, has_gauss, cached = state.rng.get_state()
    saved["rng"] = {
        "keys": torch.from_numpy(keys.astype("int64")),
        "pos": int(pos),
        "has_gauss": int(has_gauss),
        "cached": float(cached),
    }
    return saved


def load_state_dict(state: Any, saved: dict[str, Any] | None, device: torch.device) -> None:
    """A saved state back into the live hook's (its tensors onto the gradients' device)."""
    if state is None or saved is None:
        return
    for k in LEARNED:  # what the hook learned; its settings stay this run's
        setattr(state, k, _moved(saved[k], device))
    rng = saved["rng"]
    keys = rng["keys"].numpy().astype("uint32")
    state.rng.set_state(("MT19937", keys, rng["pos"], rng["has_gauss"], rng["cached"]))


LEARNED = ("error_dict", "p_memory_dict", "q_memory_dict", "iter")
"""PowerSGD's state that a resumed run continues from (beside its generator)."""


def _moved(value: Any, device: torch.device | str) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach().to(device)
    if isinstance(value, dict):
        return {k: _moved(v, device) for k, v in value.items()}
    return value


def sent_bytes(params: list[torch.Tensor], spec: str) -> int:
    """Bytes of gradient each process puts into the all-reduce per step (before the ring's
    2 (N - 1) / N): fp32 gradients as they are, half of them in 16 bits, or PowerSGD's
    factors (P and Q, fp32) for the matrices it compresses plus the rest as they are."""
    kind, rank = parse(spec)
    grads = [p for p in params if p.requires_grad]
    if kind in ("bf16", "fp16"):
        return sum(p.numel() for p in grads) * 2
    if kind != "powersgd":
        return sum(p.numel() * p.element_size() for p in grads)
    total = 0
    for p in grads:
        if p.dim() < 2:
            total += p.numel() * p.element_size()
            continue
        n, m = p.shape[0], math.prod(p.shape[1:])
        compressed = (n + m) * rank
        worth = n * m > compressed * POWERSGD_MIN_COMPRESSION_RATE
        total += (compressed if worth else n * m) * p.element_size()
    return total
