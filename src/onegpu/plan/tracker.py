"""Following a step on fake tensors: the live bytes op by op, who made each storage, where the
peak came, and (for activation offload on a GPU plan) which bytes wait in host memory."""

from __future__ import annotations

import contextlib
import weakref
from dataclasses import dataclass, field

import torch
from torch import nn

from onegpu.memory.tracker import LiveTensorBytes, holder, storage_id
from onegpu.offload import activations as offload


class ModuleStack:
    """The name of the module running now (forward pre/post hooks on every submodule)."""

    def __init__(self, model: nn.Module):
        self.stack: list[str] = []
        self.handles = []
        for name, mod in model.named_modules():
            self.handles.append(mod.register_forward_pre_hook(self._enter(name)))
            self.handles.append(mod.register_forward_hook(self._leave))

    def _enter(self, name):
        def hook(mod, args):
            self.stack.append(name)

        return hook

    def _leave(self, mod, args, out):
        if self.stack:
            self.stack.pop()

    @property
    def current(self) -> str:
        return self.stack[-1] if self.stack else ""

    def remove(self):
        for h in self.handles:
            h.remove()


WORKSPACE = -1  # pseudo storage id of a kernel's workspace in a peak snapshot


@dataclass(slots=True)
class Snapshot:
    """The live storages at one moment (allocation number -> bytes), and the module running."""

    live: int = -1
    storages: dict[int, int] = field(default_factory=dict)
    module: str = ""


@dataclass(slots=True)
class Stretch:
    """A stretch of the step in or out of backward: the moment it held the most, and the moment
    it held the most besides gradients (where a process whose gradients are sharded, under
    FSDP, holds its most: early in backward rather than at its end)."""

    in_backward: bool
    most: Snapshot = field(default_factory=Snapshot)
    most_besides_grads: Snapshot = field(default_factory=Snapshot)


NO_KERNEL = frozenset(
    {
        torch.ops.aten.empty,
        torch.ops.aten.empty_strided,
        torch.ops.aten.empty_like,
        torch.ops.aten.new_empty,
        torch.ops.aten.new_empty_strided,
    }
)
"""Ops that allocate and launch nothing; views (an op's `is_view`) and ops outside ATen (fake
tensors' `prim.device`, the profiler's ranges) launch nothing either."""
_GEMMS = (torch.ops.aten.mm, torch.ops.aten.addmm, torch.ops.aten.bmm, torch.ops.aten.baddbmm)


class PlanTracker(LiveTensorBytes):
    """LiveTensorBytes that also remembers which op made each storage and whether the peak
    came in forward or in backward/optimizer."""

    def __init__(self, modules: ModuleStack, target: str):
        super().__init__()
        self.modules = modules
        self.target = target
        self.made_by: dict[int, tuple[str, str]] = {}
        self.peak_op = ""
        self.peak_in_backward = False
        self.peak_module = ""  # the module running when the peak came ("" outside the model)
        self._op = ""
        self.param_storages: set[int] = set()
        self.weight_copies: set[int] = set()  # allocation numbers of 16-bit copies of weights
        self.on_host = False  # set while activation offload copies to the host
        # With `by_segment`: the peak of each stretch of the step in or out of backward
        # (forward, backward, forward, ..., optimizer), for plans extrapolated in depth.
        self.by_segment = False
        self.segments: list[Stretch] = []
        self._grad_sids: set[int] = set()  # live storages marked as gradients
        self._grad_bytes = 0
        self._in_backward: bool | None = None
        self._host_refs: dict[int, int] = {}
        self._host_sizes: dict[int, int] = {}
        self.host_current = 0
        self.host_peak = 0
        self.host_total = 0  # every byte copied out (each comes back once in backward)
        self.dispatched = 0  # ops that run a kernel: on a GPU, each a launch the host makes
        self.backward_ends: list[int] = []  # `dispatched` when each backward was over
        self._was_backward = False

    def _track_host(self, t: torch.Tensor) -> None:
        sid = storage_id(t)
        if sid in self._host_refs:
            self._host_refs[sid] += 1
        else:
            self._host_refs[sid] = 1
            self._host_sizes[sid] = holder(t).untyped_storage().nbytes()
            self.host_current += self._host_sizes[sid]
            self.host_total += self._host_sizes[sid]
            self.host_peak = max(self.host_peak, self.host_current)
        weakref.finalize(t, self._release_host, sid)

    def _release_host(self, sid: int) -> None:
        self._host_refs[sid] -= 1
        if not self._host_refs[sid]:
            del self._host_refs[sid]
            self.host_current -= self._host_sizes.pop(sid)

    def track(self, t: torch.Tensor) -> None:
        if self.on_host:
            self._track_host(t)
            return
        sid = storage_id(t)
        new = sid not in self.sizes
        before = self.peak
        super().track(t)
        if new:
            self.made_by[self.serials[sid]] = (self._op, self.modules.current)
        if self.peak > before:
            self._mark_peak()
        if self.by_segment:
            self._segment_peak(self.current, None)

    def mark_grad(self, t: torch.Tensor) -> None:
        """`t` is a gradient: its bytes count apart while it lives."""
        sid = storage_id(t)
        if sid in self.sizes and sid not in self._grad_sids:
            self._grad_sids.add(sid)
            self._grad_bytes += self.sizes[sid]

    def _release(self, sid: int) -> None:
        if self._refs[sid] == 1 and sid in self._grad_sids:
            self._grad_sids.discard(sid)
            self._grad_bytes -= self.sizes[sid]
        super()._release(sid)

    def _segment_peak(self, live: int, workspace: int | None) -> None:
        in_backward = torch._C._current_graph_task_id() != -1
        if in_backward != self._in_backward:
            self._in_backward = in_backward
            self.segments.append(Stretch(in_backward))
        stretch = self.segments[-1]
        storages = None  # one copy of the live storages serves both moments when they coincide
        for snapshot, bytes_ in (
            (stretch.most, live),
            (stretch.most_besides_grads, live - self._grad_bytes),
        ):
            if bytes_ > snapshot.live:
                if storages is None:
                    storages = self.live_by_serial()
                    if workspace:
                        storages[WORKSPACE] = workspace
                snapshot.live, snapshot.storages = bytes_, storages
                snapshot.module = self.modules.current

    def step_ops(self, followed: int, micro_batches: int) -> int:
        """The dispatched ops of a step of `micro_batches`, from one that ran `followed` of them:
        each micro-batch past those repeats the second one's ops (its forward and backward,
        adding into the gradients the first made; never the last's, which steps an optimizer in
        backward)."""
        ends = self.backward_ends
        if micro_batches <= followed or not ends:
            return self.dispatched
        per_micro = ends[1] - ends[0] if len(ends) >= 2 else ends[0]
        return self.dispatched + (micro_batches - followed) * per_micro

    def _count(self, func) -> None:
        """One more dispatched op, unless it is a view or an allocation alone; the count at
        the end of each backward (a micro-batch's), seen at the first op after it. A plan's
        fake tensors are on the CPU whatever the target, so a host optimizer's ops count too:
        a few per parameter, which only a step that its launches bound would show."""
        in_backward = torch._C._current_graph_task_id() != -1
        if self._was_backward and not in_backward:
            self.backward_ends.append(self.dispatched)
        self._was_backward = in_backward
        kernel = func.namespace == "aten" and not func.is_view  # not prim.device, profiler's
        if kernel and func.overloadpacket not in NO_KERNEL:
            self.dispatched += 1

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self._count(func)
        self._op = str(func.overloadpacket).replace("aten::", "aten.")
        out = super().__torch_dispatch__(func, types, args, kwargs)
        if (
            func.overloadpacket is torch.ops.aten._to_copy
            and isinstance(out, torch.Tensor)
            and storage_id(args[0]) in self.param_storages
        ):  # autocast's copy of a weight (FSDP's mixed precision gathers it in 16 bits instead)
            serial = self.serials.get(storage_id(out))
            if serial is not None:
                self.weight_copies.add(serial)
        workspace = self._cpu_gemm_workspace(func, args)
        if workspace and self.by_segment:
            self._segment_peak(self.current + workspace, workspace)
        if workspace and self.current + workspace > self.peak:
            # the kernel's own buffer, alive while the op runs: counted at the peak as "other"
            self.peak = self.current + workspace
            self.peak_storages = {**self.live_by_serial(), WORKSPACE: workspace}
            self._mark_peak()
        return out

    def _mark_peak(self) -> None:
        """Where the step is as its peak comes: the op, forward or backward, the module."""
        self.peak_op = self._op
        self.peak_in_backward = torch._C._current_graph_task_id() != -1
        self.peak_module = self.modules.current

    def _cpu_gemm_workspace(self, func, args) -> int:
        """Measured on this CPU: a 16-bit GEMM (oneDNN) first copies each transposed operand
        into a buffer of its own (e.g. g.T @ h with g 2048 x 50,304 bf16: 196 MiB beside the
        output). Shape rules do not show it; this adds it, on CPU plans only."""
        if self.target != "cpu" or func.overloadpacket not in _GEMMS:
            return 0
        mats = [a for a in args if isinstance(a, torch.Tensor) and a.dim() >= 2]
        if not mats or mats[0].dtype not in (torch.bfloat16, torch.float16):
            return 0
        return sum(m.numel() * m.element_size() for m in mats if not m.is_contiguous())


@contextlib.contextmanager
def saves_on_host(tracker: PlanTracker):
    """Activation offload on a GPU plan: fake tensors all live on the CPU, so the copies that
    `save_on_cpu` would make in host memory are followed as host bytes here, and the copy back
    in backward as device bytes (alive while backward uses it), as on the GPU."""

    def pack(t: torch.Tensor):
        tracker.on_host = True
        try:
            copy = torch.empty_like(t)
            copy.copy_(t)
        finally:
            tracker.on_host = False
        return copy

    def unpack(copy: torch.Tensor) -> torch.Tensor:
        return copy.clone()

    def hooks(pin: bool):
        return torch.autograd.graph.saved_tensors_hooks(pack, unpack)

    saved = offload.saved_to_host
    offload.saved_to_host = hooks
    try:
        yield
    finally:
        offload.saved_to_host = saved
