"""Optimizers and learning-rate schedules."""

from onegpu.optim.factory import build_optimizer, param_groups
from onegpu.optim.schedules import lr_at, set_lr

__all__ = ["build_optimizer", "lr_at", "param_groups", "set_lr"]
