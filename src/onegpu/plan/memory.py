"""Predict a training step's memory without allocating it: the same build, a fake device.

The configured model, techniques, loss and optimizer are built by the one build path under
PyTorch's FakeTensorMode (meta tensors that carry a device, so autocast and every kernel's
shape rules apply), and two real training steps run on them: the first creates the optimizer
states, the second is followed op by op by LiveTensorBytes. Nothing is allocated, so gpt2-xl or
a 7B shape plans in seconds on a laptop. Fake tensors behave like CPU tensors: a plan for a GPU
uses the CPU kernels' saved tensors, under CUDA's autocast rules (plan/cuda_autocast.py).

What the prediction covers: tensor bytes (what `torch.cuda.max_memory_allocated` and the CPU
profiler's memory timeline measure), and on a GPU the cuBLAS handles' workspaces, which that
counts too. Not covered: the CUDA context (~0.3-1 GiB), allocator caching and fragmentation
(`memory_reserved` above `allocated`), other libraries' workspaces.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections import defaultdict
from dataclasses import dataclass, field

import torch

from onegpu.backends.torch.build import FAKE_UNSAFE_OPTIMIZERS, Built, build
from onegpu.backends.torch.loader import placeholder_batch
from onegpu.cache import provisional_reads
from onegpu.config import Config, ConfigError, OptimConfig
from onegpu.distributed import DistContext
from onegpu.distributed.parallelize import local_tensor
from onegpu.distributed.shares import ParamShape
from onegpu.memory.breakdown import GROUPS
from onegpu.memory.tracker import holder, storage_id
from onegpu.models.documents import placeholder_positions
from onegpu.offload.host_optimizer import HostOffloadOptimizer
from onegpu.optim.factory import rule_state_bytes
from onegpu.optim.state_bytes import optimizer_state_bytes
from onegpu.perf.devices import CUBLAS_HANDLES
from onegpu.plan.cuda_autocast import autocast_rules
from onegpu.plan.labels import block_of, block_prefixes, saved_kind
from onegpu.plan.tracker import ModuleStack, PlanTracker, saves_on_host
from onegpu.techniques.precision import DeviceCaps, device_caps


class Unplannable(ConfigError):
    """The model's step has shapes that depend on the data (a mixture of experts routing with
    `nonzero`): fake tensors carry no values, so no plan can follow it."""


@dataclass(frozen=True, slots=True)
class Moment:
    """One moment of the step, as a process's share under FSDP needs it (plan/targets.py): the
    breakdown then, autocast's 16-bit copies of weights among it by group (saved for backward
    or not: biases, the chunked loss's output layer; FSDP's mixed precision makes none), and
    where the step was (FSDP holds a block gathered, and the next prefetched, in a block's
    forward and in backward only)."""

    memory: dict[str, int]
    weight_copies: dict[str, int]
    in_backward: bool
    in_a_block: bool

    @property
    def phase(self) -> str:
        """As `MemoryPlan.peak_phase` says it."""
        return "backward/optimizer" if self.in_backward else "forward"


@dataclass
class MemoryPlan:
    memory: dict[str, int]  # the measured breakdown's names: params, grads, ..., peak
    peak_phase: str  # "forward" or "backward/optimizer"
    peak_op: str
    saved_by_kind: dict[str, int] = field(default_factory=dict)
    saved_by_block: dict[str, int] = field(default_factory=dict)
    saved_per_micro_batch: int = 0
    n_params: int = 0
    flops_per_token: int = 0
    dispatched_ops: int = 0
    """Ops of one step that run a kernel (views and bare allocations left out), at the step's
    real number of micro-batches: on a GPU each is a launch the host makes, eagerly."""
    seconds: float = 0.0
    precision: str = ""  # what `train.precision` resolved to on the target
    loss_chunk: int = 0  # what `memory.loss_chunk` resolved to
    loss_kernel: str = ""  # what `train.loss_kernel` resolved to (its footprint is followed)
    attention: str = ""  # what `model.attention` resolved to
    provisional: tuple[str, ...] = ()
    """The cache files of timings the plan followed that the last run did not keep (timed on
    busy CPUs, perf/contention.py): the next run times them again, and may choose otherwise."""
    compute_dtype: torch.dtype = torch.float32
    param_dtype: torch.dtype = torch.float32
    weight_copies_at_peak: dict[str, int] = field(default_factory=dict)  # as Moment's
    peak_in_a_block: bool = True  # the peak came while a transformer block ran
    param_shapes: list[ParamShape] = field(default_factory=list)
    """Every parameter once (tied ones once): how FSDP would shard them."""
    block_numels: list[int] = field(default_factory=list)
    """Parameters per block (FSDP gathers one block at a time)."""
    segments: list[Moment] = field(default_factory=list)
    """With plan_memory(..., by_segment=True): two moments of each stretch of the step in or out
    of backward (forward, backward, ..., the optimizer step): its most, its most besides
    gradients."""
    offloaded_per_micro_batch: int = 0
    """Bytes activation offload copies to the host per micro-batch (and back in backward)."""
    host_by_kind: dict[str, int] = field(default_factory=dict)
    """memory['host'] split: optimizer states, weight copies, gradient buffers, pinned
    staging, activations (the offload tiers' shares of host memory)."""

    @property
    def moments(self) -> list[Moment]:
        """Each stretch's peak where the plan followed them, else the step's peak alone."""
        peak = Moment(
            self.memory,
            self.weight_copies_at_peak,
            self.peak_phase != "forward",
            self.peak_in_a_block,
        )
        return self.segments or [peak]

    @property
    def peak_key(self) -> str:
        """The column of a GPU's datasheet peaks its matmuls run at (fp32/tf32/bf16/fp16)."""
        return {"bf16-pure": "bf16"}.get(self.precision, self.precision)


@dataclass
class _FollowedStep:
    """What following one step recorded: the tracker (live bytes, peak, who made what), the
    saved storages with their module, the gradients' storages, and the exact saved total."""

    tracker: PlanTracker
    saved: dict[int, tuple[int, torch.dtype, str]]  # allocation number -> (bytes, dtype, module)
    grad_serials: set[int]
    saved_bytes: int


def _first_grad_hook(p: torch.Tensor, fn):
    """register_post_accumulate_grad_hook, but run before the hooks already there: the
    optimizer in backward and the host-offloaded optimizer free the gradient in theirs. (torch
    calls them in the insertion order of the tensor's plain hook dict.)"""
    handle = p.register_post_accumulate_grad_hook(fn)
    hooks = p._post_accumulate_grad_hooks
    earlier = [(k, v) for k, v in hooks.items() if k != handle.id]
    hooks.clear()
    hooks[handle.id] = fn
    hooks.update(earlier)
    return handle


def _follow_step(
    built: Built,
    target: str,
    x: torch.Tensor,
    y: torch.Tensor,
    positions: torch.Tensor | None,
    by_segment: bool = False,
) -> _FollowedStep:
    """Run the built step (a steady one: optimizer states already exist) op by op, labelling
    every storage it makes: saved for backward, gradient, or other."""
    model = built.model
    modules = ModuleStack(model)
    tracker = PlanTracker(modules, target)
    tracker.by_segment = by_segment
    followed = _FollowedStep(tracker, {}, set(), 0)
    counter = built.saved_counter()  # the exact total, selective caches included

    def pack(t: torch.Tensor):
        counter.pack(t)  # saved-tensor hooks do not nest: the innermost pair alone runs
        serial = tracker.serials.get(storage_id(t))
        if serial is not None and serial not in followed.saved:  # None: made before the step
            nbytes = holder(t).untyped_storage().nbytes()
            followed.saved[serial] = (nbytes, t.dtype, modules.current)
        return t

    def grad_ready(p: torch.Tensor) -> None:
        serial = tracker.serials.get(storage_id(p.grad))
        if serial is not None:
            followed.grad_serials.add(serial)
            tracker.mark_grad(p.grad)

    params = list({id(p): p for p in model.parameters()}.values())
    host_saves = saves_on_host(tracker) if target != "cpu" else contextlib.nullcontext()
    tracker.param_storages = {storage_id(p) for p in params}
    hooks = [_first_grad_hook(p, grad_ready) for p in params]
    if isinstance(built.optimizer, torch.optim.Optimizer):
        # FSDP's reduce-scattered gradients are set outside autograd: no hook sees them
        def grads_at_step(*_) -> None:
            for p in params:
                if p.grad is not None:
                    grad_ready(p)

        hooks.append(built.optimizer.register_step_pre_hook(grads_at_step))
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), host_saves, tracker:
            built.step(x, y, y.numel(), 1, positions)
    finally:
        modules.remove()
        for h in hooks:
            h.remove()
    followed.saved_bytes = counter.bytes
    return followed


def plan_memory(
    cfg: Config,
    target: str = "cpu",
    caps: DeviceCaps | None = None,
    *,
    by_segment: bool = False,
    dist_ctx: DistContext | None = None,
) -> MemoryPlan:
    """Build the configured run on fake tensors and follow one steady-state training step.

    `target` is the device type the plan is for ('cpu' or 'cuda') and `caps` its capabilities
    (default: this machine's CPU; a GPU's from the table): they decide what `auto` precision and
    attention stand for, exactly as `build` decides them for a real run. `dist_ctx`: one rank
    of a mesh over a fake process group (plan/ranks.py), whose own share and shards are followed."""
    t0 = time.perf_counter()
    device = torch.device(target)
    if caps is None and target == "cpu":
        caps = device_caps(device)
    dp = dist_ctx.dp_size if dist_ctx is not None else 1
    # Micro-batches after the second repeat it exactly (same shapes, gradients already
    # allocated), so two of them show the step's peak: planning stays fast at any accumulation.
    original_micro = cfg.grad_accum_steps // dp
    # in backward the last one also steps the optimizer: a third shows a middle one's ops
    n_micro = min(original_micro, 3 if cfg.optim.in_backward else 2)
    if cfg.dist.pp > 1:  # a pipeline's in-flight micro-batches depend on how many there are
        n_micro = cfg.grad_accum_steps // dp
    B, T = cfg.train.micro_batch_size * n_micro, cfg.train_seq_len
    train = dataclasses.replace(cfg.train, batch_size=B * dp, max_steps=2)
    cfg = dataclasses.replace(cfg, train=train)
    from torch._subclasses.fake_tensor import DynamicOutputShapeException

    reads = len(provisional_reads)
    built = build(cfg, device, with_data=False, caps=caps, fake=True, dist_ctx=dist_ctx)
    provisional = tuple(dict.fromkeys(provisional_reads[reads:]))
    try:
        with built.fake_mode, autocast_rules(target):
            x, y = placeholder_batch(B, T, built.classes)
            positions = placeholder_positions(cfg.data.packing, B, T)  # packed rows' path
            built.step(x, y, y.numel(), 0, positions)  # creates the optimizer states
            followed = _follow_step(built, target, x, y, positions, by_segment)
    except DynamicOutputShapeException as e:
        raise Unplannable("model.hf", _unplannable(built, e)) from None
    workspaces = CUBLAS_HANDLES * caps.blas_workspace if target == "cuda" and caps else 0
    plan = _label(built, cfg.optim, followed, n_micro, target, workspaces)
    plan.dispatched_ops = followed.tracker.step_ops(n_micro, original_micro)
    plan.seconds = time.perf_counter() - t0
    plan.provisional = provisional
    return plan


def _unplannable(built: Built, e: Exception) -> str:
    name = type(getattr(built.model, "hf", built.model)).__name__
    return (
        f"{name} chooses its shapes from the data ({e.args[0] if e.args else e}, the eager "
        "loop over experts), which the planner's fake tensors cannot follow: set "
        '"experts_implementation": "grouped_mm" in its config.json where transformers '
        "offers it, or measure a step with onegpu profile"
    )


def _breakdown(
    built: Built,
    followed: _FollowedStep,
    storages: dict[int, int],
    param_bytes: int,
    state_bytes: int,
    target: str,
    workspaces: int,
) -> tuple[dict[str, int], dict[str, int]]:
    """The measured names' bytes of the storages alive at one moment (and the autocast weight
    copies among them), the cuBLAS workspaces among "other"; offloaded state as host (or disk)
    bytes."""
    tracker, saved = followed.tracker, followed.saved
    at_peak: dict[str, int] = defaultdict(int)
    weight_copies: dict[str, int] = defaultdict(int)
    for serial, nbytes in storages.items():
        in_grads, in_saved = serial in followed.grad_serials, serial in saved
        group = "grads" if in_grads else "activations" if in_saved else "other"
        at_peak[group] += nbytes
        if serial in tracker.weight_copies:
            weight_copies[group] += nbytes
    memory = {
        "params": param_bytes,
        "grads": at_peak["grads"],
        "optimizer": state_bytes,
        "activations": at_peak["activations"],
        "other": at_peak["other"] + workspaces,
    }
    memory["peak"] = sum(memory.values())
    opt = built.optimizer
    if isinstance(opt, HostOffloadOptimizer):  # states, copies, buffers: host (or disk)
        memory["peak"] -= memory["optimizer"]
        host = opt.host_bytes(staging=target == "cuda")
        if opt.on_disk:  # memory.offload_dir: states and weight copies in mapped files
            memory["disk"] = memory["optimizer"] + opt.disk_bytes()
            memory["host"] = host
        else:
            memory["host"] = memory["optimizer"] + host
        memory["optimizer"] = 0
    if getattr(opt, "states", None) is not None:  # memory.offload_states: parked on the host
        memory["peak"] -= memory["optimizer"]
        memory["host"] = memory.get("host", 0) + memory["optimizer"]
        memory["optimizer"] = 0  # those on the device for their step are among "other"
    if tracker.host_peak:  # offloaded activations, at their most (the end of forward)
        memory["host"] = memory.get("host", 0) + tracker.host_peak
    return memory, dict(weight_copies)


def _host_by_kind(
    built: Built, memory: dict[str, int], activations: int, target: str
) -> dict[str, int]:
    """What memory['host'] holds, by kind (disk-tier states are on the disk, not here)."""
    by_kind: dict[str, int] = {}
    opt = built.optimizer
    if isinstance(opt, HostOffloadOptimizer):
        if not opt.on_disk:
            by_kind["optimizer states"] = (
                memory["host"] - activations - opt.host_bytes(staging=target == "cuda")
            )
        by_kind |= opt.host_bytes_by_kind(staging=target == "cuda")
    if getattr(opt, "states", None) is not None:
        by_kind["optimizer states"] = memory["host"] - activations
    if activations:
        by_kind["activations"] = activations
    return {k: v for k, v in by_kind.items() if v}


def _label(
    built: Built,
    optim: OptimConfig,
    followed: _FollowedStep,
    n_micro: int,
    target: str,
    workspaces: int,
) -> MemoryPlan:
    """The breakdown at the peak under the measured names, and the saved bytes by kind/block."""
    params = list({id(p): p for p in built.model.parameters()}.values())
    state_bytes = (
        rule_state_bytes(built.model, optim)  # the fake build stepped a stand-in
        if optim.name in FAKE_UNSAFE_OPTIMIZERS
        else optimizer_state_bytes(built.optimizer)
    )
    tracker, saved = followed.tracker, followed.saved
    param_bytes = sum(local_tensor(p).untyped_storage().nbytes() for p in params)

    def breakdown(storages: dict[int, int]) -> tuple[dict[str, int], dict[str, int]]:
        return _breakdown(built, followed, storages, param_bytes, state_bytes, target, workspaces)

    memory, weight_copies = breakdown(tracker.peak_storages)
    by_kind: dict[str, int] = defaultdict(int)
    by_block: dict[str, int] = defaultdict(int)
    prefixes = block_prefixes(built.model)
    for serial, (nbytes, dtype, module) in saved.items():
        op, made_in = tracker.made_by.get(serial, ("", module))
        by_kind[saved_kind(op, made_in or module, dtype)] += nbytes // n_micro
        by_block[block_of(module or made_in, prefixes)] += nbytes // n_micro
    return MemoryPlan(
        host_by_kind=_host_by_kind(built, memory, tracker.host_peak, target),
        memory=memory,
        peak_phase="backward/optimizer" if tracker.peak_in_backward else "forward",
        peak_op=tracker.peak_op,
        saved_by_kind=dict(sorted(by_kind.items(), key=lambda kv: -kv[1])),
        saved_by_block=dict(by_block),
        saved_per_micro_batch=followed.saved_bytes // n_micro,
        offloaded_per_micro_batch=tracker.host_total // n_micro,
        segments=[
            Moment(*breakdown(at.storages), st.in_backward, _in_a_block(at.module, prefixes))
            for st in tracker.segments
            for at in (st.most, st.most_besides_grads)
        ],
        n_params=built.n_params,  # vocabulary padding left out, as everywhere
        flops_per_token=built.flops_per_token,
        precision=built.policy.name,
        loss_chunk=built.cfg.memory.loss_chunk,
        loss_kernel=built.cfg.train.loss_kernel,
        attention=built.cfg.model.attention,
        compute_dtype=built.policy.compute_dtype,
        param_dtype=built.policy.param_dtype,
        weight_copies_at_peak=weight_copies,
        peak_in_a_block=_in_a_block(tracker.peak_module, prefixes),
        param_shapes=[ParamShape(tuple(p.shape), p.element_size()) for p in params],
        block_numels=[sum(p.numel() for p in b.parameters()) for b in built.model.blocks],
    )


def _in_a_block(module: str, prefixes: dict[str, str]) -> bool:
    return block_of(module, prefixes).startswith("blocks.")


__all__ = ["GROUPS", "MemoryPlan", "Moment", "plan_memory"]
