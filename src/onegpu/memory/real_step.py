"""A real training step's memory, measured the way `onegpu train` measures it: the reference
the planner is checked against (tests, benchmarks/plan_accuracy.py)."""

from __future__ import annotations

from typing import Any

import torch

from onegpu.build import Built, build
from onegpu.config import Config
from onegpu.memory.breakdown import profile_step_memory, with_exact_optimizer_bytes
from onegpu.memory.saved import SavedTensorCounter
from onegpu.optim.state_bytes import optimizer_state_bytes
from onegpu.train.step import forward_backward, optimizer_step


def measure_real_step(cfg: Config) -> tuple[Built, dict[str, Any], int]:
    """Two steps on random tokens (the first creates optimizer states), the second measured.
    Returns the built run, the breakdown at the step's peak (optimizer states counted exactly,
    as the trainer does) and the saved-activation bytes per micro-batch."""
    built = build(cfg, with_data=False)
    scaler = built.policy.grad_scaler(built.device)
    x = torch.randint(0, cfg.model.vocab_size, (cfg.train.batch_size, cfg.train_seq_len + 1))
    counter = SavedTensorCounter(built.model)

    def step():
        forward_backward(
            built.model, built.loss_fn, built.policy, scaler, x[:, :-1], x[:, 1:],
            n_micro=cfg.grad_accum_steps, n_tokens=x[:, 1:].numel(),
        )  # fmt: skip
        optimizer_step(built.model, built.optimizer, scaler, cfg.optim.grad_clip)

    def counted():
        with counter:
            step()

    step()
    memory = with_exact_optimizer_bytes(
        profile_step_memory(counted, built.device), optimizer_state_bytes(built.optimizer)
    )
    return built, memory, counter.bytes // cfg.grad_accum_steps
