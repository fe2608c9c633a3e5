"""Which device mesh for N processes on a named GPU, with which checkpointing and micro-batch:
`onegpu tune --gpu NAME --world-size N` where that GPU is not here, and `onegpu plan
--world-size N`'s fix list where data parallelism alone does not fit.

Every layout of N processes the configuration accepts (dp_replicate x dp_shard x tp x pp: DDP
and FSDP are two of them) is crossed with the checkpointing policies and the micro-batches. A
candidate's predicted step is arithmetic, no planning (plan/mesh.py: compute at the GPU's peak
with its recomputation, stretched by the pipeline's bubble, plus the sends it waits on), so the
candidates are planned fastest first and the first whose largest rank fits is the fastest that
fits: a search plans a few of them, not all. A lower bound of the largest rank's bytes (its
share of the weights, gradients and optimizer states, and of one micro-batch's saved
activations) skips, unplanned, those that cannot fit.
"""

from __future__ import annotations

import dataclasses
import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from onegpu.config import (
    Config,
    ConfigError,
    DistConfig,
    check_distributed,
    resolve_strategy,
    to_toml,
    with_overrides,
)
from onegpu.config.layout import Layout, resolve_layout
from onegpu.optim.state_bytes import state_bytes_per_param
from onegpu.plan.depth import plan_extrapolated, saved_per_sequence
from onegpu.plan.fixes import differs
from onegpu.plan.memory import MemoryPlan
from onegpu.plan.mesh import predicted_step
from onegpu.plan.ranks import needs_rank_plans, plan_ranks
from onegpu.plan.targets import process_share, rank_memory
from onegpu.techniques.precision import DeviceCaps

CHECKPOINTING = ("none", "selective", "block")
"""The policies a search crosses with the layouts: nothing recomputed, the cheap ops, blocks."""


def layout_overrides(layout: Layout) -> dict[str, str]:
    """`[dist]` overrides that give `layout` (DDP where the data-parallel processes replicate
    the whole model, FSDP on dp_shard otherwise)."""
    ddp = layout.dp_shard == 1 and layout.dp_replicate > 1 and not layout.splits_model
    return {
        "dist.strategy": "ddp" if ddp else "fsdp",
        "dist.dp_replicate": str(layout.dp_replicate),
        "dist.dp_shard": str(layout.dp_shard),
        "dist.tp": str(layout.tp),
        "dist.pp": str(layout.pp),
    }


def layouts(world_size: int) -> list[Layout]:
    """Every way to lay `world_size` processes on the four mesh dimensions."""
    sizes = [n for n in range(1, world_size + 1) if world_size % n == 0]
    return [
        Layout(dp_replicate=r, dp_shard=s, tp=t, pp=p)
        for r, s, t, p in itertools.product(sizes, repeat=4)
        if r * s * t * p == world_size
    ]


def candidates(
    cfg: Config, world_size: int, *, vary_techniques: bool = True
) -> list[dict[str, str]]:
    """Override sets, each a configuration the distributed build accepts for `world_size`
    processes: the layouts, crossed (`vary_techniques`) with checkpointing and micro-batch."""
    policies = CHECKPOINTING if vary_techniques else (cfg.memory.checkpointing,)
    out = []
    for layout in layouts(world_size):
        rows = cfg.train.batch_size // layout.dp
        micro = [m for m in (1, 2, 4, 8, 16, 32, 64) if m <= rows and rows % m == 0]
        if not vary_techniques:
            micro = [cfg.train.micro_batch_size]
        for policy, m in itertools.product(policies, micro):
            change = {
                **layout_overrides(layout),
                "memory.checkpointing": policy,
                "train.micro_batch_size": str(m),
            }
            try:
                c = with_overrides(cfg, change)
                check_distributed(
                    c, resolve_strategy(c.dist, world_size, "--world-size"), world_size
                )
            except ConfigError:
                continue
            out.append(change)
    return out


@dataclass(frozen=True)
class ModelFacts:
    """What every candidate's arithmetic needs of the model, planned once."""

    plan: MemoryPlan  # one process, the user's precision (parameters, FLOPs, compute dtype)
    saved: dict[str, int]  # checkpointing -> saved bytes of one sequence, one process


def model_facts(
    cfg: Config, policies: set[str], target: str, caps: DeviceCaps | None
) -> ModelFacts:
    alone = dataclasses.replace(cfg, dist=DistConfig())
    plan = plan_extrapolated(with_overrides(alone, {"train.micro_batch_size": "1"}), target, caps)
    saved = {
        p: saved_per_sequence(with_overrides(alone, {"memory.checkpointing": p}), target, caps)
        for p in policies
    }
    return ModelFacts(plan, saved)


def lower_bound(c: Config, layout: Layout, model: ModelFacts) -> int:
    """Bytes the largest rank holds at least: its share of the weights, gradients and states
    it keeps on the device, and its share of one micro-batch's saved activations (each saved
    tensor is split over tp or replicated, and some stage holds at least 1/pp of the blocks)."""
    m, o = c.memory, c.optim
    weight = 2 if c.train.precision == "bf16-pure" else 4
    on_host = m.offload_optimizer or m.offload_params or c.dist.cpu_offload
    grads = 0 if (on_host or o.in_backward) else weight
    states = 0 if on_host else state_bytes_per_param(o.name)
    shards = layout.tp * layout.pp * (layout.dp_shard if layout.data_parallel == "fsdp" else 1)
    per_param = (0 if m.offload_params else weight) + grads + states
    saved = model.saved[m.checkpointing] * c.train.micro_batch_size
    return int(model.plan.n_params * per_param / shards + saved / (layout.tp * layout.pp))


def largest_rank(
    c: Config, target: str, caps: DeviceCaps | None, world_size: int
) -> tuple[int, int]:
    """(device peak, host bytes) of the rank that needs the most: a mesh's stages planned as
    themselves, plain DDP / FSDP from one process's share (plan/targets.py)."""
    strategy = resolve_strategy(c.dist, world_size, "--world-size")
    if needs_rank_plans(c, world_size):
        plans = plan_ranks(c, target, caps, world_size)
        peak = max(p.memory["peak"] for p in plans.values())
        return peak, max(p.memory.get("host", 0) for p in plans.values())
    plan = plan_extrapolated(process_share(c, world_size), target, caps)
    mem = rank_memory(c.dist, plan, world_size, strategy)
    return mem["peak"], mem.get("host", 0)


def search_meshes(
    cfg: Config,
    gpu: str,
    caps: DeviceCaps | None,
    world_size: int,
    interconnect: str,
    budget: int,
    host_budget: int,
    *,
    vary_techniques: bool = True,
    log: Callable[[str], None] = lambda _: None,
) -> dict[str, Any]:
    """The candidates by predicted step time; planned in that order until one fits (its
    largest rank within `budget` on the device and `host_budget` on the host)."""
    t0 = time.perf_counter()
    cands = candidates(cfg, world_size, vary_techniques=vary_techniques)
    model = model_facts(cfg, {c["memory.checkpointing"] for c in cands}, "cuda", caps)
    scored = []
    for change in cands:
        c = with_overrides(cfg, change)
        step = predicted_step(c, model.plan, gpu, world_size, interconnect)
        layout = resolve_layout(c.dist, world_size)
        # at equal predicted time: the larger micro-batch (GPUs run it faster than counted),
        # then the fewer model-splitting processes
        tie_break = -int(change["train.micro_batch_size"]), layout.tp + layout.pp
        scored.append((step["predicted_step_time_s"], tie_break, change, c, layout, step))
    scored.sort(key=lambda s: (s[0], s[1]))
    rows, best, skipped = [], None, 0
    log(f"mesh search: {len(cands)} candidates for {world_size} x {gpu}, fastest predicted first")
    for step_s, _, change, c, layout, step in scored:
        if lower_bound(c, layout, model) > budget:
            skipped += 1
            continue
        peak, host = largest_rank(c, "cuda", caps, world_size)
        fits = peak <= budget and host * world_size <= host_budget
        rows.append(_row(change, layout, step, peak, host, fits, cfg))
        log(f"  {rows[-1]['label']}: {peak / 2**30:,.1f} GiB, {step_s * 1e3:,.0f} ms/step")
        if fits:
            best = rows[-1]
            best["best_toml"] = to_toml(c)
            break
    return {
        "gpu": gpu,
        "world_size": world_size,
        "interconnect": interconnect,
        "candidates": len(cands),
        "skipped_by_arithmetic": skipped,
        "planned": len(rows),
        "rows": rows,
        "best": best,
        "seconds": time.perf_counter() - t0,
    }


def _row(change, layout: Layout, step, peak: int, host: int, fits: bool, base: Config) -> dict:
    return {
        "change": change,
        "label": f"{layout.describe()}, remat {change['memory.checkpointing']}, micro "
        f"{change['train.micro_batch_size']}",
        "peak_bytes": peak,
        "host_bytes": host,
        "step_s": step["predicted_step_time_s"],
        "tokens_per_s": step["predicted_tokens_per_s"],
        "bytes_per_step": step["bytes_per_step"],
        "bubble": step["bubble"],
        "fits": fits,
        "overrides": {k: v for k, v in change.items() if differs(base, k, v)},
    }
