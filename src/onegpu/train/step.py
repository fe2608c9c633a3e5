"""One optimizer step: micro-batches -> loss -> backward, then clip -> optimizer step.

Reads top to bottom and never synchronises with the device (phases are annotated with
`record_function` for `onegpu profile`): losses and norms stay device
tensors until the trainer reads them once per log step.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.profiler import record_function

from onegpu.optim.in_backward import OptimizerInBackward
from onegpu.techniques.loss import LossFn
from onegpu.techniques.precision import PrecisionPolicy


def forward_backward(
    model: nn.Module,
    loss_fn: LossFn,
    policy: PrecisionPolicy,
    scaler: torch.amp.GradScaler,
    inputs_BT: torch.Tensor,
    targets_BT: torch.Tensor,
    *,
    n_micro: int,
    n_tokens: int,
) -> torch.Tensor:
    """Accumulate gradients of the optimizer batch over n_micro micro-batches.

    Each micro-batch's summed loss is divided by n_tokens, the number of target tokens in the
    whole batch, so the accumulated gradient equals the full-batch mean-loss gradient.
    Returns the batch's mean loss (a device tensor).
    """
    total: torch.Tensor | None = None
    denom = max(n_tokens, 1)
    for x_bT, y_bT in zip(inputs_BT.chunk(n_micro), targets_BT.chunk(n_micro), strict=True):
        with record_function("forward"), policy.autocast(inputs_BT.device):
            loss = loss_fn(model, x_bT, y_bT) / denom
        with record_function("backward"):
            scaler.scale(loss).backward()
        total = loss.detach() if total is None else total + loss.detach()
    assert total is not None
    return total


def optimizer_step(
    model: nn.Module,
    optimizer: torch.optim.Optimizer | OptimizerInBackward,
    scaler: torch.amp.GradScaler,
    grad_clip: float,
) -> torch.Tensor:
    """Unscale, clip by global norm, step (skipped by the scaler on inf/nan), zero grads.

    Returns the pre-clip global gradient norm (a device tensor). With the optimizer in
    backward the step has already happened: only the norm is collected.
    """
    if isinstance(optimizer, OptimizerInBackward):
        return optimizer.pop_grad_norm()
    with record_function("optimizer"):
        return _clip_and_step(model, optimizer, scaler, grad_clip)


def _clip_and_step(model, optimizer, scaler, grad_clip) -> torch.Tensor:
    scaler.unscale_(optimizer)
    params = [p for p in model.parameters() if p.grad is not None]
    if grad_clip > 0:
        norm = torch.nn.utils.clip_grad_norm_(params, grad_clip, foreach=True)
    else:
        norm = torch.nn.utils.get_total_norm([p.grad for p in params], foreach=True)
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad(set_to_none=True)
    return norm
