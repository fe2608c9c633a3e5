"""Learning rate as a pure function of the step: resumable, testable, no scheduler state."""

from __future__ import annotations

import torch

from onegpu.config.schedule import lr_at

__all__ = ["lr_at", "set_lr"]


def set_lr(optimizer, lr: float) -> None:
    """Set every group's learning rate; in place where the optimizer keeps it as a tensor
    (torchao's low-bit optimizers do, so that a compiled step is not recompiled per value)."""
    for group in optimizer.param_groups:
        if isinstance(group["lr"], torch.Tensor):
            group["lr"].fill_(lr)
        else:
            group["lr"] = lr
