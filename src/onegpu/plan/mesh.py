"""`onegpu plan --world-size N` for a device mesh (tensor or pipeline parallelism, HSDP): each
pipeline stage's rank planned as itself (plan/ranks.py), the bytes each mesh dimension sends,
and the step time on the named GPU and interconnect (plan/links.py)."""

from __future__ import annotations

from typing import Any

import torch

from onegpu.config import Config, resolve_strategy
from onegpu.config.layout import bubble, resolve_layout
from onegpu.distributed import compression
from onegpu.plan import links
from onegpu.plan.memory import MemoryPlan
from onegpu.plan.ranks import plan_ranks, stage_ranks
from onegpu.plan.targets import EFFICIENCY, busy_seconds, compute_seconds, dispatch_seconds


def mesh_plans(
    cfg: Config, target: str, caps: Any, world_size: int
) -> tuple[dict[int, MemoryPlan], int]:
    """{rank: plan} for one rank per stage, and the rank with the highest peak."""
    plans = plan_ranks(cfg, target, caps, world_size)
    largest = max(plans, key=lambda r: plans[r].memory["peak"])
    return plans, largest


def mesh_section(
    cfg: Config,
    plans: dict[int, MemoryPlan],
    gpu: str | None,
    world_size: int,
    interconnect: str,
) -> dict[str, Any]:
    """The report's `dist` part: the layout, each stage's memory, the bytes per dimension and
    the predicted step."""
    layout = resolve_layout(cfg.dist, world_size)
    plan = next(iter(plans.values()))
    step = predicted_step(cfg, plan, gpu, world_size, interconnect)
    ranks = [
        {"rank": r, "stage": r // (world_size // layout.pp), "memory": plans[r].memory}
        for r in stage_ranks(layout)
    ]
    section: dict[str, Any] = {
        "strategy": resolve_strategy(cfg.dist, world_size, "--world-size"),
        "world_size": world_size,
        "layout": layout.sizes(),
        "ranks": ranks,
        "reshard_after_forward": cfg.dist.reshard_after_forward,
        "cpu_offload": cfg.dist.cpu_offload,
    }
    section.update(step)
    return section


def _param_like(plan: MemoryPlan) -> list[torch.Tensor]:
    """Meta tensors of the plan's parameter shapes (what PowerSGD's count reads)."""
    return [torch.empty(p.shape, device="meta") for p in plan.param_shapes]


def predicted_step(
    cfg: Config, plan: MemoryPlan, gpu: str | None, world_size: int, interconnect: str
) -> dict[str, Any]:
    """The bytes each mesh dimension sends per step and, where the peak FLOP/s are known, the
    step time: compute (recomputation included) stretched by the pipeline's bubble, plus the
    sends it waits on. Any layout, plain DDP and FSDP included; `plan` gives the model's
    parameters, FLOPs and compute dtype (any rank's or one process's plan)."""
    layout = resolve_layout(cfg.dist, world_size)
    shape = links.step_shape(
        cfg, layout, plan.n_params, torch.empty((), dtype=plan.compute_dtype).element_size()
    )
    ddp_sent = plan.n_params * 4
    if cfg.dist.grad_compression != "none":
        ddp_sent = compression.sent_bytes(_param_like(plan), cfg.dist.grad_compression)
    sent = links.bytes_per_step(
        layout,
        shape,
        reshard=cfg.dist.reshard_after_forward,
        ddp_sent=ddp_sent,
        interleaved=cfg.dist.pp_schedule == "interleaved-1f1b",
    )
    out: dict[str, Any] = {
        "bytes_per_step": sent,
        "micro_batches": shape.micro_batches,
        "interconnect": interconnect,
    }
    compute_s = compute_seconds(cfg, plan, gpu, world_size)
    if compute_s is None:
        return out
    tokens = cfg.train.batch_size * cfg.train_seq_len
    idle = bubble(layout, cfg.dist.pp_schedule, shape.micro_batches)
    sent_s = links.seconds(sent, interconnect)
    # each process launches its own ops: a small model's step waits on its host
    step_s = links.step_seconds(
        busy_seconds(compute_s, dispatch_seconds(cfg, plan, gpu)), sent_s, idle
    )
    out.update(
        compute_s=compute_s,
        bubble=idle,
        seconds_per_step_sending=sent_s,
        predicted_step_time_s=step_s,
        predicted_tokens_per_s=tokens / step_s,
        efficiency_assumed=EFFICIENCY,
        link_efficiency_assumed=links.LINK_EFFICIENCY,
    )
    return out
