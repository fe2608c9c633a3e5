"""What each mesh dimension sends per step, and what that costs on a named interconnect.

Counted per process and step, from the layout and the model's shapes, with ring collectives
(an all-gather or reduce-scatter of S bytes over n processes sends (n - 1)/n x S from each, an
all-reduce twice that; a pipeline send is S):

- tp: per block and micro-batch, two all-gathers of the sequence (after each norm) and two
  reduce-scatters (after each output projection) in forward, the same in backward, each of one
  [micro-batch, seq, d_model] activation; the embedding and the output layer add one each way;
  recomputed blocks (activation checkpointing) repeat their forward's.
- dp_shard (FSDP2): per micro-batch, the stage's tp-split weights all-gathered for forward and
  (resharded after it) again for backward, and its gradients reduce-scattered in fp32.
- dp_replicate: HSDP all-reduces the shards' gradients between replicas per micro-batch; DDP
  all-reduces all gradients once per step (compressed as dist.grad_compression says).
- pp: per micro-batch, a middle stage sends the residual stream on and its gradient back, an
  end stage one of the two; twice that with two stages per process (interleaved).

A prediction, labelled as one: rates are datasheet rates per direction at LINK_EFFICIENCY, and
only the FSDP traffic is taken to overlap with compute (it prefetches); tensor-parallel and
pipeline sends wait on the step.
"""

from __future__ import annotations

from dataclasses import dataclass

from onegpu.config import Config
from onegpu.config.layout import Layout

INTERCONNECTS = {
    "nvlink": 450e9,  # NVLink 4 (H100 SXM): 900 GB/s both ways
    "nvlink3": 300e9,  # NVLink 3 (A100 SXM): 600 GB/s both ways
    "pcie4": 31.5e9,  # PCIe 4.0 x16
    "pcie5": 63e9,  # PCIe 5.0 x16
    "ib-200": 25e9,  # InfiniBand HDR, 200 Gb/s per GPU
    "ib-400": 50e9,  # InfiniBand NDR, 400 Gb/s per GPU
}
"""Datasheet bytes/s per direction of the link between two GPUs."""
LINK_EFFICIENCY = 0.7
"""Of a datasheet rate, what collectives achieve (NCCL's bus bandwidth on NVLink and IB)."""


@dataclass(frozen=True, slots=True)
class StepShape:
    """What the counts need of a configuration."""

    n_layer: int
    d_model: int
    seq_len: int
    micro_batch: int
    micro_batches: int  # per process per step
    params: int  # every parameter, elements
    activation_bytes: int  # the compute dtype's
    param_bytes: int  # the weights' dtype (what crosses a pipeline stage boundary)
    gather_bytes: int  # what FSDP gathers in (16 bits under its mixed precision)
    recompute: bool  # whole blocks recomputed in backward


def step_shape(cfg: Config, layout: Layout, params: int, compute_bytes: int) -> StepShape:
    t, m = cfg.train, cfg.model
    rows = t.batch_size // layout.dp
    pp_micro = cfg.dist.pp_microbatches if layout.pp > 1 else 0
    micro_batches = pp_micro or rows // t.micro_batch_size
    param_bytes = 2 if t.precision == "bf16-pure" else 4
    return StepShape(
        n_layer=m.n_layer,
        d_model=m.d_model,
        seq_len=cfg.train_seq_len,
        micro_batch=rows // micro_batches,
        micro_batches=micro_batches,
        params=params,
        activation_bytes=compute_bytes,
        param_bytes=param_bytes,
        gather_bytes=min(compute_bytes, param_bytes),
        recompute=cfg.memory.checkpointing in ("block", "attn+mlp"),
    )


def bytes_per_step(
    layout: Layout, s: StepShape, *, reshard: bool, ddp_sent: int, interleaved: bool
) -> dict[str, int]:
    """{mesh dimension: bytes one process sends per step} for the dimensions above 1."""
    out: dict[str, int] = {}
    act = s.micro_batch * s.seq_len * s.d_model
    blocks = s.n_layer / layout.pp
    if layout.tp > 1:
        per_block = 8 + (4 if s.recompute else 0)
        collectives = s.micro_batches * (per_block * blocks + 4)
        out["tp"] = int(collectives * act * s.activation_bytes * (layout.tp - 1) / layout.tp)
    weights = s.params / (layout.pp * layout.tp)  # this process's stage, split by tp
    if layout.dp_shard > 1:
        gathers = 2 if reshard else 1
        share = (layout.dp_shard - 1) / layout.dp_shard
        per_micro = weights * (gathers * s.gather_bytes + 4) * share
        out["dp_shard"] = int(s.micro_batches * per_micro)
    if layout.dp_replicate > 1:
        share = 2 * (layout.dp_replicate - 1) / layout.dp_replicate
        if layout.dp_shard > 1:  # HSDP: each micro-batch's gradient shards
            out["dp_replicate"] = int(s.micro_batches * weights / layout.dp_shard * 4 * share)
        else:  # DDP: once per step, as compressed
            out["dp_replicate"] = int(ddp_sent * share)
    if layout.pp > 1:  # a middle stage sends the activation on and the gradient back, the
        sends = 2 if layout.pp > 2 else 1  # first and last stages one of the two
        stages = 2 if interleaved else 1  # stages per process
        out["pp"] = int(s.micro_batches * sends * stages * act * s.param_bytes)
    return out


def seconds(sent: dict[str, int], interconnect: str) -> dict[str, float]:
    rate = INTERCONNECTS[interconnect] * LINK_EFFICIENCY
    return {dim: n / rate for dim, n in sent.items()}


def step_seconds(compute_s: float, sent_s: dict[str, float], bubble_share: float) -> float:
    """Compute stretched by the bubble, plus the sends the step waits on; FSDP's traffic only
    where it outlasts the compute it overlaps."""
    waits = sent_s.get("tp", 0.0) + sent_s.get("pp", 0.0) + sent_s.get("dp_replicate", 0.0)
    busy = compute_s / (1 - bubble_share)
    return busy + waits + max(0.0, sent_s.get("dp_shard", 0.0) - busy)
