"""Learning rate as a pure function of the step: resumable, testable, no scheduler state, and
the same on both backends."""

from __future__ import annotations

import dataclasses
import math

from onegpu.config.options import Config, OptimConfig


def scaled_optim(cfg: Config) -> OptimConfig:
    """The optimizer settings a run steps with: optim.lr scaled from optim.base_batch to the
    global batch as optim.lr_scaling says (linear: x batch/base; sqrt: x its square root)."""
    o = cfg.optim
    if o.lr_scaling == "none":
        return o
    ratio = cfg.train.batch_size / o.base_batch
    return dataclasses.replace(o, lr=o.lr * (ratio if o.lr_scaling == "linear" else ratio**0.5))


def lr_at(step: int, cfg: OptimConfig, max_steps: int) -> float:
    """Linear warmup from 0 over warmup_steps, then cosine / exponential / constant."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    if cfg.schedule == "constant":
        return cfg.lr
    done = step - cfg.warmup_steps
    if cfg.schedule == "exp":  # optax.warmup_exponential_decay_schedule, as in Lippe's tutorial
        return cfg.lr * cfg.decay_rate**done
    # cosine from lr to min_lr_ratio*lr after warmup (Wang, "Let's reproduce NanoGPT with JAX")
    total = max(1, max_steps - cfg.warmup_steps)
    progress = min(1.0, done / total)
    floor = cfg.lr * cfg.min_lr_ratio
    return floor + 0.5 * (cfg.lr - floor) * (1.0 + math.cos(math.pi * progress))
