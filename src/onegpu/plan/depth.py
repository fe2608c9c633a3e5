"""A deep model's plan from two shallow copies of it, for searches that plan many configurations.

Following a step of Llama-3-8B on fake tensors takes ~20 s on a laptop CPU, and a search (the
fix list, `onegpu plan --largest`, `onegpu tune` for a named GPU) plans dozens. Blocks repeat:
what a step keeps at its peak grows linearly in depth (every block adds the same weights,
gradients, states and saved activations) as long as the peak comes at the same place. So the
search plans the model at depths a and b (a few blocks each, a second or two) and extrapolates
every figure linearly to the real depth; where the two shallow plans peak at different ops the
line does not hold and the full plan is made instead. `onegpu plan` itself always follows the
full model; tests/tools/test_depth_plan.py holds the two to each other.
"""

from __future__ import annotations

import dataclasses
import math

from onegpu.config import Config, DistConfig, parse_checkpointing, with_overrides
from onegpu.distributed.shares import ParamShape
from onegpu.plan.memory import MemoryPlan, Moment, plan_memory
from onegpu.plan.shapes import block_pattern, shape_of, with_depth
from onegpu.techniques.precision import DeviceCaps


def shallow_depths(cfg: Config) -> tuple[int, int]:
    """Depths to plan at: whole periods of the checkpointing policy (`every:K` checkpoints
    blocks 0, K, 2K, ...) and of the model's blocks (experts in every other block), at least
    two blocks (the first and last block differ from the rest in some models: the embedding's
    output, the final norm's input), past the leading blocks built unlike the rest (DeepSeek-V3's
    three dense layers: copies of two and three blocks would have no experts at all)."""
    lead, pattern = block_pattern(cfg)
    period = math.lcm(parse_checkpointing(cfg.memory.checkpointing).every, pattern)
    a = max(2, period) if period == 1 else 2 * period
    a += -(-lead // period) * period  # whole periods, so the checkpointed blocks stay aligned
    return a, a + period


def plan_extrapolated(
    cfg: Config, target: str = "cpu", caps: DeviceCaps | None = None
) -> MemoryPlan:
    """`plan_memory(cfg, ...)`, from two shallow plans where the model is deep enough."""
    depth = shape_of(cfg).n_layer
    a, b = shallow_depths(cfg)
    per_block = parse_checkpointing(cfg.memory.checkpointing).kind == "blocks"
    if depth <= b + (b - a) or per_block:  # a per-block plan has no shallow copy
        return plan_memory(cfg, target, caps, by_segment=True)
    pa = plan_memory(with_depth(cfg, a), target, caps, by_segment=True)
    pb = plan_memory(with_depth(cfg, b), target, caps, by_segment=True)
    if len(pa.segments) != len(pb.segments):  # the step runs differently: no line to follow
        return plan_memory(cfg, target, caps, by_segment=True)

    def line(va: int, vb: int) -> int:
        return round(va + (vb - va) * (depth - a) / (b - a))

    def lines(da: dict[str, int], db: dict[str, int]) -> dict[str, int]:
        return {k: line(da.get(k, 0), db.get(k, 0)) for k in {**da, **db}}

    # the step's peak is the highest of its stretches' peaks, each a line in depth
    segments = [
        Moment(
            lines(sa.memory, sb.memory),
            lines(sa.weight_copies, sb.weight_copies),
            sb.in_backward,
            sa.in_a_block or sb.in_a_block,
        )
        for sa, sb in zip(pa.segments, pb.segments, strict=True)
    ]
    peak = max(segments, key=lambda m: m.memory["peak"])
    block = pb.block_numels[-1] if pb.block_numels else 0
    elt = pb.param_shapes[-1].element_size if pb.param_shapes else 4
    return dataclasses.replace(
        pb,
        memory=peak.memory,
        segments=segments,
        peak_phase=peak.phase,
        peak_in_a_block=peak.in_a_block,
        weight_copies_at_peak=peak.weight_copies,
        saved_by_kind=lines(pa.saved_by_kind, pb.saved_by_kind),
        # the middle blocks all alike: the shallow model's last block stands for each one
        saved_by_block={
            **{k: v for k, v in pb.saved_by_block.items() if not k.startswith("blocks.")},
            **{f"blocks.{i}": pb.saved_by_block.get(f"blocks.{b - 1}", 0) for i in range(depth)},
        },
        saved_per_micro_batch=line(pa.saved_per_micro_batch, pb.saved_per_micro_batch),
        provisional=tuple(dict.fromkeys(pa.provisional + pb.provisional)),
        n_params=line(pa.n_params, pb.n_params),
        flops_per_token=line(pa.flops_per_token, pb.flops_per_token),
        dispatched_ops=line(pa.dispatched_ops, pb.dispatched_ops),  # each block its own ops
        seconds=pa.seconds + pb.seconds,
        # the shallow model's parameters and, per block added, one flat block (the same bytes)
        param_shapes=pb.param_shapes + [ParamShape((block,), elt)] * (depth - b),
        block_numels=[block] * depth,
        offloaded_per_micro_batch=line(pa.offloaded_per_micro_batch, pb.offloaded_per_micro_batch),
    )


def saved_per_sequence(cfg: Config, target: str, caps: DeviceCaps | None) -> int:
    """The saved activations of one sequence that grow with the micro-batch, one process
    (searches' lower bounds): not autocast's copies of the weights (one per forward, whatever
    the micro-batch) nor the logits (the chunked loss changes them)."""
    one = with_overrides(
        dataclasses.replace(cfg, dist=DistConfig()),
        {
            "train.micro_batch_size": "1",
            "train.batch_size": "1",
            "memory.offload_activations": "false",
        },
    )
    plan = plan_extrapolated(one, target, caps)
    per_forward = ("16-bit copies (autocast)", "logits / loss")
    return sum(v for k, v in plan.saved_by_kind.items() if k not in per_forward)
