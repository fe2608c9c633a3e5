"""The optimizer in host memory (`memory.offload_optimizer`): ZeRO-Offload for one device.

Optimizer states and a host copy of every weight (the master the optimizer updates) live in
host memory, pinned where an accelerator exists; the device keeps only the weights the forward
uses. As backward produces each parameter's gradient (`register_post_accumulate_grad_hook`),
it is copied on a side stream through a bounded ring of pinned staging memory
(offload/staging_ring.py) into a host buffer, and the device gradient is freed, so full
gradients never sit on the device. The step runs on the CPU (fused AdamW on CPU, or any
optimizer onegpu builds, torchao's 8-bit AdamW and the Kahan optimizers of bf16-pure
included: the host then holds 8-bit or Kahan-compensated states, which no other tool offers),
and the updated weights are copied back to the device.

What it takes from torchao's `CPUOffloadOptimizer` (the design: per-parameter hooks, a side
stream, pinned host copies, H2D after the step) and why it is ours: torchao's refuses every
device but CUDA/XPU (our tests and CPU runs need it), frees device gradients only without
accumulation, clips nothing (the global norm needs every gradient), and steps one optimizer per
parameter (its checkpoints do not load into the non-offloaded optimizer). Here:

- Gradients accumulate on the host, in the host copy's dtype (fp32 under fp32/bf16/fp16): a
  micro-batch's gradient is added to the buffer, exactly what autograd's accumulation on the
  device computes, so the result is bit-identical to not offloading on a CPU.
- The global norm (clipping, the non-finite guard, fp16's inf check) is taken over the host
  gradients once the batch's backward is done: the step waits for the last gradient anyway
  when clipping, and reading the norm costs no device sync (it is a host tensor).
- One optimizer over the host copies, with the model's parameter groups: its state_dict has
  the layout of the device optimizer's, so a checkpoint written offloaded resumes without
  offload and the other way round.

Under `bf16` (autocast over fp32 weights) the matmul weights live in bf16 on the device and
their fp32 masters on the host (`sixteen_bit`): autocast would cast them to bf16 for every
matmul anyway, so forward and backward compute the same values at half the device bytes, and
their bf16 gradients are summed into fp32 host buffers as autograd sums them into fp32 ones.
Embeddings (tied output layers too) and norms stay fp32 on the device. Checkpoints and the
final weights keep the fp32 masters.

With `memory.offload_dir` the weight copies and the states live in memory-mapped files instead
(offload/disk_tier.py); the gradient buffers stay in RAM.

On a CPU the "device" and the host are the same memory: offloading then only adds copies (the
machinery's overhead, measured in benchmarks/offload.py), and is what the tests run.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import threading
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from onegpu.offload.disk_tier import DiskTier, step_into_disk
from onegpu.offload.staging_ring import ALIGN, StagingRing


class HostOffloadOptimizer:
    """Looks like an optimizer to the step: `param_groups` (for the LR schedule and the loss
    scaler, holding the host copies and their gradients), `step`, `zero_grad`, `state_dict`.
    `grad_params` lists the host copies in the model's parameter order (the norm's order)."""

    _step_supports_amp_scaling = False  # the guard reads its host-side norm instead

    def __init__(
        self,
        groups: list[dict[str, Any]],
        make_optimizer: Callable[[list[dict[str, Any]]], torch.optim.Optimizer],
        device: torch.device,
        model_params: list[torch.Tensor],
        *,
        disk: DiskTier | None = None,
        on_disk: bool = False,
        sixteen_bit: frozenset[int] = frozenset(),
    ):
        self.device = device
        pin = device.type == "cuda"
        self.disk = disk  # memory.offload_dir: weight copies and states in mapped files
        self.on_disk = on_disk or disk is not None  # (a plan has the tier but makes no files)
        self._states_on_disk = False
        self._host: dict[torch.Tensor, torch.Tensor] = {}  # device param -> host copy
        host_groups = []
        for group in groups:
            host_params = []
            for p in group["params"]:
                if disk is not None:
                    h = disk.tensor_like(p.detach().to("cpu"))
                else:
                    h = torch.empty(p.shape, dtype=p.dtype, device="cpu", pin_memory=pin)
                    h.copy_(p.detach())
                h.grad = torch.zeros_like(h)  # the accumulation buffer, reused every step
                self._host[p] = h
                host_params.append(h)
                p.register_post_accumulate_grad_hook(self._offload_grad)
            host_groups.append({**group, "params": host_params})
        self.inner = make_optimizer(host_groups)
        # under bf16: the matmul weights live in bf16 on the device, their fp32 masters here
        self.sixteen_bit = [p for p in self._host if id(p) in sixteen_bit]
        for p in self.sixteen_bit:
            p.data = p.data.to(torch.bfloat16)
        # one optimizer per host copy (optim.in_backward): each steps as its gradient lands
        self.steps_in_backward = getattr(self.inner, "steps_in_backward", False)
        seen: set[int] = set()
        self.grad_params = []  # host copies in model order, each once (tied weights)
        for p in model_params:
            if id(p) not in seen and p in self._host:
                seen.add(id(p))
                self.grad_params.append(self._host[p])
        self._stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        # pinned staging: a ring of twice the largest gradient (offload/staging_ring.py)
        largest = max((p.numel() * p.element_size() for p in self._host), default=0)
        self.ring_bytes = 2 * (largest + ALIGN)
        self._ring: StagingRing | None = None  # made at the first copy (a plan makes none)
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None
        self._worker_jobs: list[concurrent.futures.Future] = []

    # ------------------------------------------------------------------ backward: out they go

    @torch.no_grad()
    def _offload_grad(self, p: torch.Tensor) -> None:
        """Add `p`'s new gradient into its host buffer, then free it on the device."""
        host = self._host[p].grad
        grad, p.grad = p.grad, None
        if self._stream is None:  # same memory: a plain add, as autograd accumulates
            host.add_(grad.to(host.dtype))
            self._step_if_whole(p)
            return
        # The copy waits for backward to have produced the gradient, runs beside the rest of
        # backward into the staging ring, and the device buffer lives until it is done.
        if self._ring is None:
            self._ring = StagingRing(self.ring_bytes, pin=True)
        staging = self._ring.take(grad.numel(), grad.dtype).view(grad.shape)
        self._stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self._stream):
            staging.copy_(grad, non_blocking=True)
            grad.record_stream(self._stream)
        arrived = (self._stream.record_event(), host, staging)
        if self.steps_in_backward and self.inner.stepping:  # on a worker thread: backward goes on
            landed = threading.Event()  # the staged bytes are added in: reusable
            self._worker_jobs.append(self._worker().submit(self._step_on_host, p, arrived, landed))
            self._ring.hold(landed.wait)
        else:
            self._ring.hold(lambda: _add_arrived(arrived))

    @contextlib.contextmanager
    def accumulating(self) -> Iterator[None]:
        """A backward inside only accumulates (in backward: a micro-batch before the last).
        Its gradients are all in their host buffers after it: the last micro-batch's steps,
        on the worker thread, add onto whole sums."""
        with self.inner.accumulating():
            yield
        self.wait_for_gradients()

    def _step_if_whole(self, p: torch.Tensor) -> None:
        """In backward on a CPU, once `p`'s gradient is whole: step its host copy and take the
        new weight (the same memory: no link, no thread)."""
        if self.steps_in_backward and self.inner.stepping:
            p.copy_(self._stepped_copy(p))

    def _stepped_copy(self, p: torch.Tensor) -> torch.Tensor:
        """Step `p`'s host copy on its whole gradient, zero that gradient; the new weight."""
        h = self._host[p]
        # A named range in traces of the thread that steps (the profiler follows no worker
        # thread it did not start: benchmarks/gpu_suite.py times those steps itself).
        with torch.profiler.record_function("onegpu.host_step"):
            self.inner.step_param(h)
        h.grad.zero_()
        return h

    @torch.no_grad()
    def _step_on_host(
        self,
        p: torch.Tensor,
        arrived: tuple[Any, torch.Tensor, torch.Tensor],
        landed: threading.Event,
    ):
        """In backward with an accelerator, on the worker thread while the device goes on with
        backward: wait for `p`'s gradient copy, add it in, step the host copy on the CPU and
        send the weight back on the side stream (ordered after the gradient's copy, which
        waited for every kernel queued before it that reads the old weight)."""
        try:
            _add_arrived(arrived)
        finally:  # the ring may hand the staged bytes out again (an error is raised at step)
            landed.set()
        h = self._stepped_copy(p)
        with torch.cuda.stream(self._stream):
            _send(p, h)

    def _worker(self) -> concurrent.futures.ThreadPoolExecutor:
        """One thread: the host steps run in order, beside the engine's."""
        if self._pool is None:
            self._pool = concurrent.futures.ThreadPoolExecutor(1, "onegpu-host-step")
        return self._pool

    def pop_grad_norm(self) -> torch.Tensor:
        """In backward: the global norm of the gradients stepped since the last call."""
        return self.inner.pop_grad_norm()

    def wait_for_gradients(self) -> None:
        """Every gradient of the backward passes so far is in its host buffer."""
        if self._ring is not None:
            self._ring.drain()

    # ------------------------------------------------------------------ the step, on the host

    def gradients(self) -> list[torch.Tensor]:
        """The host copies holding the batch's gradients (all of them have arrived), in the
        model's parameter order."""
        self.wait_for_gradients()
        return self.grad_params

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.inner.param_groups

    @property
    def state(self) -> dict[torch.Tensor, dict[str, Any]]:
        return self.inner.state

    @torch.no_grad()
    def step(self, closure=None) -> None:
        """Step the host copies, then bring the updated weights back to the device (in
        backward: each was stepped and sent already; the next forward waits for the sends)."""
        if self.steps_in_backward:
            jobs, self._worker_jobs = self._worker_jobs, []
            self.wait_for_gradients()
            for job in jobs:
                job.result()  # every host step done (and its error raised here)
            if self._stream is not None:
                torch.cuda.current_stream(self.device).wait_stream(self._stream)
            return
        self.wait_for_gradients()
        if self.disk is not None and not self._states_on_disk:
            step_into_disk(self.inner, self.disk)  # states made one parameter at a time
            self._states_on_disk = True
        else:
            self.inner.step()
        self._copy_to_device()

    @torch.no_grad()
    def _copy_to_device(self) -> None:
        if self._stream is not None:  # nothing queued on the device still reads the old weights
            self._stream.wait_stream(torch.cuda.current_stream(self.device))
        ctx = torch.cuda.stream(self._stream) if self._stream else contextlib.nullcontext()
        with ctx:
            for p, h in self._host.items():
                _send(p, h)
        if self._stream is not None:  # the next forward must see the new weights
            torch.cuda.current_stream(self.device).wait_stream(self._stream)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Host buffers back to zero for the next batch; device gradients are already gone
        (in backward, each host buffer was zeroed when its copy stepped)."""
        if self.steps_in_backward:
            return
        for h in self._host.values():
            h.grad.zero_()
        for p in self._host:
            p.grad = None

    def host_bytes(self, *, staging: bool) -> int:
        """Host memory besides the optimizer's states: the weight copies (unless they are on
        the disk) and the gradient buffers (and, with an accelerator, the pinned staging
        buffers of the gradients)."""
        return sum(self.host_bytes_by_kind(staging=staging).values())

    def host_bytes_by_kind(self, *, staging: bool) -> dict[str, int]:
        """`host_bytes`, split: weight copies, gradient buffers, pinned staging buffers."""
        copies = sum(h.numel() * h.element_size() for h in self._host.values())
        by_kind = {"weight copies": 0 if self.on_disk else copies, "gradient buffers": copies}
        if staging:  # the ring the gradients leave the device through
            by_kind["pinned staging"] = self.ring_bytes
        return by_kind

    def disk_bytes(self) -> int:
        """Bytes of weight copies the disk tier holds (the states' come on top)."""
        if not self.on_disk:
            return 0
        return sum(h.numel() * h.element_size() for h in self._host.values())

    def state_dict(self) -> dict[str, Any]:
        return self.inner.state_dict()

    @torch.no_grad()
    def load_state_dict(self, state: dict[str, Any]) -> None:
        """The states as saved (by this optimizer or a device one: same layout), and the host
        copies taken from the device weights, which a checkpoint loads first."""
        self.inner.load_state_dict(state)
        if self.disk is not None and self.inner.state:
            for per_param in self.inner.state.values():
                self.disk.move_state(per_param)
            self._states_on_disk = True
        self.sync_from_device()

    def full_precision_state(self, model: nn.Module) -> dict[str, torch.Tensor]:
        """The model's state_dict with the fp32 masters in place of its bf16 device weights
        (what a checkpoint and the final weights keep)."""
        state = model.state_dict()
        if self.sixteen_bit:
            masters = {id(p): self._host[p] for p in self.sixteen_bit}
            for name, p in model.named_parameters(remove_duplicate=False):
                if id(p) in masters:
                    state[name] = masters[id(p)]
        return state

    @torch.no_grad()
    def take_weights(self, model: nn.Module, state: dict[str, torch.Tensor]) -> None:
        """The host copies from a checkpoint's model state (its fp32 values: the device's
        bf16 weights are rounded ones), after the model has loaded it."""
        for name, p in model.named_parameters():
            if p in self._host and name in state:
                self._host[p].copy_(state[name])

    @torch.no_grad()
    def sync_from_device(self) -> None:
        """Take the device weights as the host copies (after a checkpoint loaded the model)."""
        for p, h in self._host.items():
            h.copy_(p.detach())


def _add_arrived(arrived: tuple[Any, torch.Tensor, torch.Tensor]) -> None:
    """Wait for a gradient's copy to the host and add it into its buffer (the staged bytes
    may be reused after)."""
    event, host, staging = arrived
    event.synchronize()
    host.add_(staging.to(host.dtype))


def _send(p: torch.Tensor, h: torch.Tensor) -> None:
    """The host copy's values into the device weight. A bf16 weight of an fp32 master is
    converted on the device: converting on the host would stage the bf16 values in pageable
    memory, which the link copies synchronously."""
    if p.dtype != h.dtype and p.device != h.device:
        h = h.to(p.device, non_blocking=True)
    p.copy_(h, non_blocking=p.device.type == "cuda")
