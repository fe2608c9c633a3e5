"""Each rank's memory under any device mesh, from its own step on fake tensors.

Tensor and pipeline parallelism and HSDP change what every tensor of a step is on each process,
so instead of deriving a rank's figures from the single-process plan (distributed/shares.py does
that for plain FSDP and DDP), the planner builds the run *as that rank*: a fake process group
of the job's world size (torch's `fake` backend: collectives that move nothing), the same
DeviceMesh, the same build, the same step on fake tensors, the same tracker. What it follows is
the rank's own shards, its part of the batch, its sequence-parallel activations and its
stage's blocks. One rank per pipeline stage is planned (the ranks of a stage hold the same);
the largest is each process's figure.

A process that already has a process group (torchrun's, during the run's memory check) plans
in a child process of its own: one default group per process.
"""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import torch
import torch.distributed as dist

from onegpu.config import Config, resolve_strategy, to_toml
from onegpu.config.layout import Layout, resolve_layout
from onegpu.distributed import DistContext
from onegpu.distributed.context import device_mesh
from onegpu.plan.memory import MemoryPlan, plan_memory
from onegpu.techniques.precision import DeviceCaps


def needs_rank_plans(cfg: Config, world_size: int) -> bool:
    """Whether the layout is one the single-process plan cannot be scaled to (a mesh)."""
    if world_size == 1:
        return False
    layout = resolve_layout(cfg.dist, world_size)
    return layout.splits_model or (layout.dp_replicate > 1 and layout.dp_shard > 1)


def stage_ranks(layout: Layout) -> list[int]:
    """One rank per pipeline stage (its other coordinates 0): the ranks whose plans differ."""
    per_stage = layout.world_size // layout.pp
    return [stage * per_stage for stage in range(layout.pp)]


@contextlib.contextmanager
def fake_processes(world_size: int, rank: int) -> Iterator[None]:
    """A default process group whose collectives move nothing: this process is `rank`."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():  # planning happens before (or outside) a run's processes
        raise RuntimeError("a process group is already open: plan ranks in a process of its own")
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()
        _forget_sharding_decisions()


def _forget_sharding_decisions() -> None:
    """DTensor caches its sharding decisions by mesh *shape*, and each cached decision holds
    the mesh it was made on: the next rank's plan (same shape, new groups) would reuse a mesh
    whose process groups died with this fake group. Cleared where this torch has the caches."""
    from torch.distributed.tensor import DTensor

    propagator = DTensor._op_dispatcher.sharding_propagator
    for name in ("propagate_op_sharding", "_propagate_tensor_meta_cached"):
        cache_clear = getattr(getattr(propagator, name, None), "cache_clear", None)
        if cache_clear is not None:
            cache_clear()
    native = getattr(torch._C, "_clear_DTensor_sharding_propagator_cache", None)
    if native is not None:  # the C++ dispatch fast path keeps its own copy
        native()


def plan_rank(
    cfg: Config, target: str, caps: DeviceCaps | None, world_size: int, rank: int
) -> MemoryPlan:
    """The plan of process `rank` of `world_size` (in this process: no group may be open)."""
    layout = resolve_layout(cfg.dist, world_size)
    with fake_processes(world_size, rank):
        ctx = DistContext(
            strategy=resolve_strategy(cfg.dist, world_size),
            rank=rank,
            world_size=world_size,
            backend="fake",
            layout=layout,
            mesh=device_mesh(layout, "cpu"),
        )
        return plan_memory(cfg, target, caps, dist_ctx=ctx)


def plan_ranks(
    cfg: Config, target: str, caps: DeviceCaps | None, world_size: int
) -> dict[int, MemoryPlan]:
    """{rank: plan} for one rank of each pipeline stage."""
    layout = resolve_layout(cfg.dist, world_size)
    return {r: plan_rank(cfg, target, caps, world_size, r) for r in stage_ranks(layout)}


def rank_needs(cfg: Config, target: str, world_size: int) -> dict[int, dict[str, int]]:
    """{rank: {'peak', 'host'}} for one rank of each stage; in a child process when this one
    has a process group already (torchrun's)."""
    if not dist.is_initialized():
        plans = plan_ranks(cfg, target, None, world_size)
        return {r: _need(p) for r, p in plans.items()}
    with tempfile.TemporaryDirectory() as tmp:
        config = Path(tmp) / "config.toml"
        config.write_text(to_toml(cfg))
        out = subprocess.run(
            [sys.executable, "-m", "onegpu.plan.ranks", str(config), target, str(world_size)],
            capture_output=True,
            text=True,
            check=True,
            env=_without_torchrun(),
        )
    return {int(r): need for r, need in json.loads(out.stdout.splitlines()[-1]).items()}


def _need(plan: MemoryPlan) -> dict[str, int]:
    return {"peak": plan.memory["peak"], "host": plan.memory.get("host", 0)}


def _without_torchrun() -> dict[str, str]:
    import os

    names = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    return {
        k: v for k, v in os.environ.items() if k not in names and not k.startswith("TORCHELASTIC")
    }


if __name__ == "__main__":  # the child of rank_needs: config.toml target world_size
    from onegpu.config import load_config

    path, where, size = sys.argv[1:4]
    needs = rank_needs(load_config(None, path), where, int(size))
    print(json.dumps(needs))
