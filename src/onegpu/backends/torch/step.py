"""The one training step every command runs: train, profile, plan, tune, bench, memory checks.

    micro-batches -> forward (autocast) -> loss / tokens of the whole batch -> backward (scaled)
    -> unscale -> clip -> optimizer step (skipped on a non-finite loss or gradient) -> zero grads

The step owns everything that differs between techniques at step time (autocast, the loss
scaler, accumulation, clipping, the optimizer stepped inside backward, the skipped-step flag),
so the loops that call it never branch on precision, optimizer kind or compile. It never reads
a value back from the device: loss, gradient norm and the skipped flag are returned as device
tensors, read by the caller once per log step. Phases are annotated with `record_function`
(`forward`, `backward`, `optimizer`) for `onegpu profile`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch._subclasses.fake_tensor import is_fake
from torch.profiler import record_function

from onegpu.backends.torch.loader import count_targets
from onegpu.config import Config, OptimConfig
from onegpu.distributed import DistContext, single_process
from onegpu.distributed.parallelize import full_tensor
from onegpu.distributed.pipeline import Pipeline
from onegpu.models.documents import documents
from onegpu.models.protocol import LossFn
from onegpu.offload.host_optimizer import HostOffloadOptimizer
from onegpu.optim import lr_at, set_lr
from onegpu.optim.in_backward import PerParameterOptimizers
from onegpu.perf.logits import saved_block_bytes
from onegpu.techniques.precision import PrecisionPolicy


@dataclass(frozen=True, slots=True)
class StepOutput:
    loss: torch.Tensor
    """Mean loss over the target tokens of the whole batch (device tensor)."""
    grad_norm: torch.Tensor
    """Global L2 norm of the gradients before clipping (device tensor)."""
    skipped: torch.Tensor
    """True if the update was skipped: a non-finite loss or gradient (fp16: the loss scaler's
    overflow test) left parameters and optimizer state untouched (device tensor)."""
    lr: float
    """The learning rate this step used."""


def reuses_casts(cfg: Config, dist: DistContext) -> bool:
    """Whether a step's micro-batches share autocast's 16-bit weight copies
    (`PrecisionPolicy.casts_once`) without raising the step's peak. Held copies stay alive
    through each backward, where they would otherwise be freed layer by layer; that is free
    where the peak is at the end of a forward, where every copy is alive anyway. So not:
    - where backward drops the copies early: checkpointing (recomputes them block by block)
      and activations on the host (the copies are then most of the device's peak);
    - where the step's peak is late in backward: blocks that save less than twice the copies'
      bytes a micro-batch (a weight-bound step, e.g. `seed-ref` at 128 tokens: +9% planned);
    - where a process holds no whole weights: FSDP (incl. weights on the host) gathers them in
      16 bits already, tensor parallelism's are DTensors."""
    m, mem = cfg.model, cfg.memory
    whole = dist.strategy in ("none", "ddp") and dist.layout.tp == 1 and not mem.offload_params
    kept = mem.checkpointing == "none" and not mem.offload_activations
    copies = 2 * m.n_layer * (4 + 2 * m.mlp_ratio) * m.d_model**2  # q, k, v, o and the MLP
    saved = saved_block_bytes(m, cfg.train.micro_batch_size * cfg.train_seq_len, 2)
    return whole and kept and saved >= 2 * copies


class TrainStep:
    """`step(inputs_BT, targets_BT, n_tokens, index)` runs one optimizer step of the batch.

    Exact accumulation: each micro-batch's summed loss is divided by `n_tokens`, the number of
    target tokens in the whole batch, so the accumulated gradient equals the full-batch mean-loss
    gradient even with padding and uneven micro-batches (never an average of micro-batch means).

    Under torchrun each process runs its share of the global batch (`n_micro` micro-batches)
    and `n_tokens` still counts the whole global batch's targets: FSDP/DDP average the
    processes' gradients, so each divides its summed loss by n_tokens / world_size, and the
    average is the full-batch gradient. DDP's all-reduce is held back (`no_sync`) until the last
    micro-batch; FSDP reduce-scatters every micro-batch, so no process ever holds whole gradients.
    """

    def __init__(
        self,
        *,
        model: nn.Module,
        loss_fn: LossFn,
        optimizer: torch.optim.Optimizer | PerParameterOptimizers | HostOffloadOptimizer,
        policy: PrecisionPolicy,
        device: torch.device,
        optim: OptimConfig,
        max_steps: int,
        n_micro: int,
        dist: DistContext | None = None,
        no_sync: Callable[[], contextlib.AbstractContextManager] | None = None,
        loss_context: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
        pipeline: Pipeline | None = None,
        reuse_casts: bool = False,
    ):
        self.model, self.loss_fn, self.optimizer = model, loss_fn, optimizer
        self.dist = dist or single_process()
        self.no_sync = no_sync
        self.loss_context = loss_context
        self.pipeline = pipeline
        self.policy, self.device = policy, device
        self.optim, self.max_steps, self.n_micro = optim, max_steps, n_micro
        # A disabled scaler (every precision but fp16) passes values through unchanged.
        self.scaler = policy.grad_scaler(device)
        self._false: torch.Tensor | None = None
        # Chosen once here, so that no call branches on the optimizer's kind.
        in_backward = getattr(optimizer, "steps_in_backward", False)
        self._update = self._collect_in_backward_norm if in_backward else self._clip_and_step
        # Micro-batches before the last only accumulate (the optimizer in backward steps in
        # the last one's backward; the others step after it anyway).
        self._accumulating = optimizer.accumulating if in_backward else contextlib.nullcontext
        # Autocast's weight copies made once a step, not once a micro-batch (reuses_casts).
        self._casts = policy.casts_once if n_micro > 1 and reuse_casts else contextlib.nullcontext
        # Where the batch's gradients are: on the parameters, or in the host optimizer's
        # buffers (memory.offload_optimizer), in the model's parameter order either way.
        self._gradients = (
            optimizer.gradients
            if isinstance(optimizer, HostOffloadOptimizer)
            else lambda: [p for p in self.model.parameters() if p.grad is not None]
        )

    def __call__(
        self,
        inputs_BT: torch.Tensor,
        targets_BT: torch.Tensor,
        n_tokens: int,
        index: int,
        positions_BT: torch.Tensor | None = None,
    ) -> StepOutput:
        """Optimizer step number `index` (0-based: it sets the scheduled learning rate).
        `positions_BT`: rows of packed documents (models/documents.py); None: one a row."""
        lr = lr_at(index, self.optim, self.max_steps)
        set_lr(self.optimizer, lr)
        loss = self.forward_backward(inputs_BT, targets_BT, n_tokens, positions_BT)
        with record_function("optimizer"):
            grad_norm, skipped = self._update(loss)
        if grad_norm.device != loss.device:  # gradients on the host (offloaded): the meter
            grad_norm, skipped = grad_norm.to(loss.device), skipped.to(loss.device)  # sums here
        return StepOutput(loss=loss, grad_norm=grad_norm, skipped=skipped, lr=lr)

    def forward_backward(
        self,
        inputs_BT: torch.Tensor,
        targets_BT: torch.Tensor,
        n_tokens: int,
        positions_BT: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Accumulate the batch's gradients over the micro-batches; returns its mean loss."""
        dp = self.dist.dp_size  # processes that split the batch (tensor-parallel ones share it)
        denom = max(n_tokens, 1) / dp
        if self.pipeline is not None:
            total = self._through_pipeline(inputs_BT, targets_BT, denom)
        else:
            total = self._micro_batches(inputs_BT, targets_BT, positions_BT, denom)
        world = self.dist.world_size
        if world > 1:  # the mean over processes of their (dp-scaled) shares: the batch's loss
            dist.all_reduce(total)  # (a tensor-parallel group's processes hold the same; a
            total = total / (world // self.dist.layout.pp)  # pipeline's last stage alone)
        return total

    def _micro_batches(
        self,
        inputs_BT: torch.Tensor,
        targets_BT: torch.Tensor,
        positions_BT: torch.Tensor | None,
        denom: float,
    ) -> torch.Tensor:
        total: torch.Tensor | None = None
        n = self.n_micro
        positions = [None] * n if positions_BT is None else positions_BT.chunk(n)
        micro = list(zip(inputs_BT.chunk(n), targets_BT.chunk(n), positions, strict=True))
        with self._casts():
            for i, (x_bT, y_bT, pos_bT) in enumerate(micro):
                last = i == len(micro) - 1
                hold = self.no_sync is not None and not last
                with (
                    self.no_sync() if hold else contextlib.nullcontext(),
                    contextlib.nullcontext() if last else self._accumulating(),
                    self.loss_context(),
                    documents(self.model, pos_bT),
                ):
                    with record_function("forward"), self.policy.autocast(inputs_BT.device):
                        loss = self.loss_fn(self.model, x_bT, y_bT) / denom
                    with record_function("backward"):
                        self.scaler.scale(loss).backward()
                total = loss.detach() if total is None else total + loss.detach()
        assert total is not None  # n_micro >= 1
        return total

    def _through_pipeline(
        self, inputs_BT: torch.Tensor, targets_BT: torch.Tensor, denom: float
    ) -> torch.Tensor:
        """The schedule runs every micro-batch's forward and backward over the stages."""
        self.pipeline.denominator = denom
        autocast = self.policy.autocast(inputs_BT.device)
        with record_function("forward_backward"), self.loss_context(), autocast:
            return self.pipeline.forward_backward(inputs_BT, targets_BT)

    def _clip_and_step(self, loss: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        params = self._gradients()
        self.scaler.unscale_(self.optimizer)
        norm = torch.nn.utils.get_total_norm([p.grad for p in params], foreach=True)
        norm = self.dist.across_stages(full_tensor(norm))  # every shard's, every stage's
        if self.optim.grad_clip > 0:
            torch.nn.utils.clip_grads_with_norm_(params, self.optim.grad_clip, norm, foreach=True)
        if self.scaler.is_enabled():
            # The scaler skips the update iff some gradient is inf/nan, i.e. iff the global norm
            # is not finite: the same test, kept on the device (get_scale() would sync).
            skipped = torch.isfinite(norm).logical_not_()
            self.scaler.step(self.optimizer)
            self.scaler.update()
        else:  # fp32/bf16: a non-finite loss or gradient must not reach the weights either
            finite_loss = torch.isfinite(loss)
            if finite_loss.device != norm.device:  # gradients on the host: the guard runs there
                finite_loss = finite_loss.to(norm.device)
            skipped = torch.isfinite(norm).logical_and_(finite_loss).logical_not_()
            self._guarded_step(skipped)
        self.optimizer.zero_grad(set_to_none=True)
        return norm, skipped

    def _guarded_step(self, skipped: torch.Tensor) -> None:
        """Step unless `skipped`: no parameter or optimizer state changes on a skipped step.

        torch's fused optimizers (AdamW, the default) take the flag on the device, as they do
        from GradScaler (`found_inf`): no sync. The others are asked on the host: one sync per
        step for them on a GPU (GradScaler does the same for non-fused optimizers)."""
        if getattr(self.optimizer, "_step_supports_amp_scaling", False):
            self.optimizer.found_inf = skipped.to(torch.float32)
            try:
                self.optimizer.step()
            finally:
                del self.optimizer.found_inf
        elif is_fake(skipped) or not bool(skipped):  # a planned (fake) step is a normal step
            self.optimizer.step()

    def _collect_in_backward_norm(self, loss: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Every parameter was stepped inside backward: only the norm is left to collect (and
        on the host tier, the weights' copies back to wait for)."""
        self.optimizer.step()
        norm = self.optimizer.pop_grad_norm()
        return norm, self._not_skipped(norm)

    def _not_skipped(self, like: torch.Tensor) -> torch.Tensor:
        """A constant False on the device, made once (no kernel per step)."""
        if self._false is None or self._false.device != like.device:
            self._false = torch.zeros((), dtype=torch.bool, device=like.device)
        return self._false

    def log_extras(self) -> dict[str, Any]:
        """Figures only some runs have, for the log line (reads the device: log steps only): the
        fp16 loss scale; a mixture of experts' router balancing term (coefficient x aux loss,
        included in `loss`) of the last micro-batch."""
        extras = {"loss_scale": self.scaler.get_scale()} if self.scaler.is_enabled() else {}
        aux = self.model.last_auxiliary
        if aux is not None:
            extras["router_aux_loss"] = aux.item()
        return extras

    @torch.no_grad()
    def evaluate(self, batches: list[tuple[torch.Tensor, ...]]) -> float:
        """Mean next-token loss over fixed batches (summed, then divided by target tokens);
        a batch is (inputs, targets) or, packed, (inputs, targets, positions)."""
        was_training = self.model.training
        self.model.eval()
        total = torch.zeros((), device=self.device, dtype=torch.float64)
        n = 0
        for x, y, *pos in batches:
            n += count_targets(y)
            x, y = x.to(self.device), y.to(self.device)
            positions = pos[0].to(self.device) if pos else None
            with (
                self.policy.autocast(self.device),
                self.loss_context(),
                documents(self.model, positions),
            ):
                if self.pipeline is not None:
                    total += self.pipeline.evaluate(x, y).double()
                else:
                    total += self.loss_fn(self.model, x, y).double()
        self.model.train(was_training)
        return total.item() / max(n, 1)
