"""Who this process is in a `torchrun` job, and the process group it talks through.

torchrun sets RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT for every process it
starts (on one machine or, with --nnodes and --rdzv-*, on several); `init_distributed` reads
them, picks the backend (nccl on CUDA, gloo on CPU) and opens the default process group. Beside
it, a gloo group carries the few host-side agreements of the loop (stop on a signal, errors
before the build) so that they never wait on a GPU stream.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from onegpu.config import ConfigError, DistConfig, resolve_strategy
from onegpu.config.environment import (
    launched_by_torchrun,
    local_rank_from_env,
    restart_count,
    world_size_from_env,
)
from onegpu.config.layout import MESH_DIMS, Layout, resolve_layout

T = TypeVar("T")
# Set once this process has opened a process group: its gloo threads may outlive
# destroy_process_group (FSDP2 keeps the group referenced from C++), see `opened_a_group`.
_OPENED = False
__all__ = ["DistContext", "init_distributed", "resolve_strategy", "single_process"]


@dataclass(frozen=True, slots=True)
class DistContext:
    """`strategy` 'none' is the single-process run: every helper below is then a no-op."""

    strategy: str  # "none" | "fsdp" | "ddp"
    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    backend: str | None = None
    control: Any = None  # a gloo ProcessGroup for host-side agreement (None: the default one)
    saver: Any = None  # a gloo ProcessGroup of its own for background checkpoint writes
    layout: Layout = Layout()
    """The mesh's dimensions (config/layout.py); a plain FSDP or DDP job has only dp."""
    mesh: Any = None
    """The DeviceMesh over the dimensions above 1, where the model is split or HSDP runs (None:
    FSDP and DDP over the default group, as before meshes)."""

    @property
    def enabled(self) -> bool:
        return self.strategy != "none" or self.world_size > 1

    def coordinate(self, dim: str) -> int:
        """This process's index along a mesh dimension (0 where the dimension is 1)."""
        sizes = self.layout.sizes()
        inner = 1
        for name in reversed(MESH_DIMS):  # the last dimension varies fastest
            if name == dim:
                return self.rank // inner % sizes[name]
            inner *= sizes[name]
        raise KeyError(dim)

    @property
    def dp_rank(self) -> int:
        """This process's place among the processes that split the batch."""
        return self.coordinate("dp_replicate") * self.layout.dp_shard + self.coordinate("dp_shard")

    @property
    def dp_size(self) -> int:
        return self.layout.dp if self.enabled else 1

    @property
    def random_stream(self) -> int:
        """Which random stream this process's dropout draws from. Tensor-parallel processes
        hold other positions and heads of one activation, pipeline stages other layers: each
        needs masks of its own (Megatron offsets its seed per tp and pp rank alike). Processes
        that split the batch share a stream: their masks fall on other samples."""
        return self.coordinate("pp") * self.layout.tp + self.coordinate("tp")

    def stage_group(self) -> Any:
        """The process group along the pipeline (None: no pipeline)."""
        mesh = self.submesh("pp")
        return mesh.get_group() if mesh is not None else None

    def across_stages(self, norm: torch.Tensor) -> torch.Tensor:
        """A gradient norm over every pipeline stage's parameters from this stage's (each
        stage holds other weights: their squares add up)."""
        if self.layout.pp == 1:
            return norm
        squared = norm.double() ** 2
        dist.all_reduce(squared, group=self.stage_group())
        return squared.sqrt().to(norm.dtype)

    def submesh(self, *dims: str) -> Any:
        """The mesh of those of `dims` above 1 (None: none of them, or no mesh)."""
        from torch._subclasses.fake_tensor import unset_fake_temporarily

        present = tuple(d for d in dims if self.layout.sizes()[d] > 1)
        if self.mesh is None or not present:
            return None
        with unset_fake_temporarily():  # slicing runs tensor ops: never fake ones (a plan's)
            return self.mesh[present] if len(present) > 1 else self.mesh[present[0]]

    @property
    def is_main(self) -> bool:
        """Rank 0 writes the run folder, the metrics and the final weights."""
        return self.rank == 0

    def any_true(self, flag: bool) -> bool:
        """Whether `flag` is true on any process (every process must call it)."""
        if not self.enabled:
            return flag
        t = torch.tensor([int(flag)], dtype=torch.int32)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.control)
        return bool(t.item())

    def broadcast(self, obj: Any) -> Any:
        """Rank 0's `obj` on every process (pickled, over the control group)."""
        if not self.enabled:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=0, group=self.control)
        return box[0]

    def gather(self, obj: Any) -> list[Any]:
        """Every process's `obj`, in rank order, on every process."""
        if not self.enabled:
            return [obj]
        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, obj, group=self.control)
        return out

    def on_main(self, fn: Callable[[], T]) -> T:
        """fn() on rank 0 only; its result (pickled) or its ConfigError on every process."""
        if not self.enabled:
            return fn()
        outcome: tuple = ("ok", None)
        if self.is_main:
            try:
                outcome = ("ok", fn())
            except ConfigError as e:
                outcome = ("error", e.field_name, str(e)[len(e.field_name) + 2 :])
        outcome = self.broadcast(outcome)
        if outcome[0] == "error":
            raise ConfigError(outcome[1], outcome[2])
        return outcome[1]

    def main_first(self, fn: Callable[[], T]) -> T:
        """fn() on rank 0 first, then on the others (which then find rank 0's caches: the
        tokenized data). A ConfigError on rank 0 is raised on every process, so none waits."""
        if not self.enabled:
            return fn()
        result: list[T] = []
        self.on_main(lambda: result.append(fn()))
        return result[0] if self.is_main else fn()

    def say(self, message: str, write: Callable[[str], None] = print) -> None:
        """Rank 0 speaks for every process."""
        if self.is_main:
            write(message)

    def rows(self, n: int) -> slice:
        """This process's rows of a global batch of `n`: its data-parallel share (processes
        that split the model between them take the same rows; one process takes them all)."""
        i, k = self.dp_rank, self.dp_size
        return slice(i * n // k, (i + 1) * n // k)

    def barrier(self) -> None:
        if self.enabled:
            dist.barrier(group=self.control)


def single_process() -> DistContext:
    return DistContext(strategy="none")


def init_distributed(cfg: DistConfig, device_type: str, *, alone: bool = False) -> DistContext:
    """Open the process group torchrun describes (once per process; later calls reuse it).
    `alone`: outside torchrun, a process group of this one process (weights offloaded through
    FSDP2 need no launcher)."""
    world_size = world_size_from_env()
    strategy = resolve_strategy(cfg, world_size)
    if strategy == "none" and world_size == 1:
        return single_process()
    outside = not launched_by_torchrun() and not dist.is_initialized()
    if outside and not alone:
        raise ConfigError(
            "dist.strategy",
            f"{strategy} needs the processes torchrun starts: launch with "
            "`torchrun --nproc-per-node N -m onegpu train ...` (or use --dist.strategy none)",
        )
    backend = cfg.backend
    if backend == "auto":
        backend = "nccl" if device_type == "cuda" else "gloo"
    if backend == "nccl" and device_type != "cuda":
        raise ConfigError("dist.backend", "nccl needs CUDA devices; use gloo (or auto) on CPUs")
    local_rank = local_rank_from_env()
    if device_type == "cuda":
        torch.cuda.set_device(local_rank)
    global _OPENED
    _OPENED = True
    if outside:  # one process, its store in memory: no address, no port
        dist.init_process_group(backend=backend, store=dist.HashStore(), rank=0, world_size=1)
    elif not dist.is_initialized():
        dist.init_process_group(backend=backend, **_attempt_store())
    control = dist.new_group(backend="gloo") if backend != "gloo" else None
    # An asynchronous checkpoint's thread runs DCP's collectives while the loop runs its own:
    # on a group of their own, the two can never interleave differently on two processes.
    saver = dist.new_group(backend="gloo")
    layout = resolve_layout(cfg, world_size)
    return DistContext(
        strategy=strategy,
        rank=dist.get_rank(),
        local_rank=local_rank,
        world_size=dist.get_world_size(),
        backend=backend,
        control=control,
        saver=saver,
        layout=layout,
        mesh=device_mesh(layout, device_type),
    )


def device_mesh(layout: Layout, device_type: str) -> Any:
    """The DeviceMesh of the dimensions above 1, named as in the config (`mesh["tp"]`), when
    the model is split or HSDP runs; None for plain FSDP or DDP (the default group)."""
    from torch.distributed.device_mesh import init_device_mesh

    dims = {name: n for name, n in layout.sizes().items() if n > 1}
    if not layout.splits_model and len(dims) < 2:
        return None
    mesh = init_device_mesh(device_type, tuple(dims.values()), mesh_dim_names=tuple(dims))
    names = tuple(dims)
    for width in range(2, len(names) + 1):  # flattened runs of dimensions: a norm or a
        for first in range(len(names) - width + 1):  # gather over several is one collective
            mesh[names[first : first + width]]._flatten()
    return mesh


def _attempt_store() -> dict:
    """Under torchrun's restarts (`--max-restarts`): the launcher's store, whose keys outlive a
    failed attempt, behind a prefix of this attempt's own. Without it a restarted process can
    read a dead process's gloo address (our extra groups multiply the keys) and fail in
    connectFullMesh ("Connection refused") or hang. {} outside torchelastic."""
    attempt = restart_count()
    if attempt is None:
        return {}
    store, rank, world_size = next(dist.rendezvous("env://"))
    prefixed = dist.PrefixStore(f"onegpu/attempt_{attempt}", store)
    return {"store": prefixed, "rank": rank, "world_size": world_size}


def opened_a_group() -> bool:
    """Whether this process opened a process group. After FSDP2, destroy_process_group leaves
    the group alive (referenced from C++, its gloo threads running) until the interpreter
    tears itself down, where a rare exit ends in "terminate called without an active
    exception" (SIGABRT) instead of the run's exit code: such a process leaves at the end
    without that teardown (`onegpu.cli.entry`)."""
    return _OPENED


def shutdown(ctx: DistContext) -> None:
    """Close the process group at the end of a run (torchrun expects it)."""
    if ctx.enabled and dist.is_initialized():
        dist.destroy_process_group()
