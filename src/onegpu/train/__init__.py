"""`onegpu.train(cfg)`: the one entry of every run. It picks the backend `train.backend`
names and runs it through the one lifecycle (runs/lifecycle.py); importing it loads no torch,
so a JAX run never does."""

from __future__ import annotations

from typing import Any

from onegpu.config import Config, ConfigError
from onegpu.runs.backend import Backend
from onegpu.runs.lifecycle import run


def train(cfg: Config) -> dict[str, Any]:
    """Run training as configured; returns the summary also written to summary.json."""
    if cfg.train.backend == "jax":
        return run(cfg, jax_backend())
    from onegpu.backends.torch.oom import TrainingOutOfMemory

    try:
        return run(cfg, torch_backend())
    except TrainingOutOfMemory as e:  # the planner's cheapest fixes, as one line
        from onegpu.plan.oom import explain

        raise ConfigError("out of memory", explain(cfg, e)) from None


def torch_backend() -> Backend:
    """The torch backend, with the planner's start-up memory check and checkpointing by budget
    (the planner sits above the backends: it builds on fake tensors through the torch build)."""
    from onegpu.backends.torch.backend import TorchBackend
    from onegpu.plan.startup import budget_for_run, check_memory

    return TorchBackend(memory_check=check_memory, plan_checkpointing=budget_for_run)


def jax_backend() -> Backend:
    from onegpu.backends.jax import require_jax

    require_jax()
    from onegpu.backends.jax.backend import JaxBackend

    return JaxBackend()


__all__ = ["train"]
