"""A real training step's memory, measured: where its peak goes and what it saves for backward.

The trainer measures its second step this way (optimizer states exist by then, as in every
later step); `measure_real_step` does the same on random tokens for the planner's accuracy
checks (tests, benchmarks/plan_accuracy.py).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from onegpu.backends.torch.build import Built, build
from onegpu.backends.torch.loader import classification_targets, count_targets
from onegpu.backends.torch.resolve import resolve, resolve_device
from onegpu.backends.torch.step import StepOutput
from onegpu.config import Config
from onegpu.distributed.parallelize import local_tensor
from onegpu.memory.breakdown import profile_step_memory, with_exact_optimizer_bytes
from onegpu.models.documents import placeholder_positions
from onegpu.optim.state_bytes import optimizer_state_bytes
from onegpu.perf.allocator import release_free_memory


def measured_step(built: Built) -> int | None:
    """The step whose memory a run measures (`train.measure_memory`): the second, when
    optimizer states exist as in every later step (under torchrun each process measures its
    own); None when turned off."""
    t = built.cfg.train
    if not t.measure_memory:
        return None
    return min(1, t.max_steps - 1)


def measure_step(
    built: Built,
    inputs_BT: torch.Tensor,
    targets_BT: torch.Tensor,
    n_tokens: int,
    index: int,
    positions_BT: torch.Tensor | None = None,
) -> tuple[StepOutput, dict]:
    """Run `built.step` once, on this batch, under the memory profiler and the saved-tensor
    counter.

    Returns its output and the breakdown at the step's peak (`params, grads, optimizer,
    activations, other, peak`; optimizer states counted exactly) plus the saved bytes of one
    micro-batch."""
    outputs: list[StepOutput] = []
    counter = built.saved_counter()

    def step() -> None:
        with counter:
            outputs.append(built.step(inputs_BT, targets_BT, n_tokens, index, positions_BT))

    memory: dict[str, Any] = profile_step_memory(step, built.device)
    release_free_memory()  # the profile's pages: otherwise kept for the rest of the run
    states = optimizer_state_bytes(built.optimizer)
    if "allocated_in_step" in memory:  # no breakdown: what lived before, plus the step's most
        params = {id(p): local_tensor(p) for p in built.model.parameters()}.values()
        before = sum(p.untyped_storage().nbytes() for p in params) + states
        memory["peak"] = before + memory["allocated_in_step"]
        memory["kind"] = "parameters and optimizer states + the allocator's most during the step"
        memory["params"], memory["optimizer"] = before - states, states
    else:
        with_exact_optimizer_bytes(memory, states)
    # micro-batches have equal shapes, so each saves the same bytes
    memory["saved_activations_per_micro_batch"] = counter.bytes // built.step.n_micro
    return outputs[0], memory


def planned_kernels(cfg: Config) -> Config:
    """`cfg` with the kernels a plan of it picks (attention, loss chunk and loss kernel) set,
    and compile off, as the planner follows the eager step. A plan made in a process that is
    not the run reads what the last `onegpu train` here chose, even a timing not kept for a
    busy CPU; the measured step must run those kernels rather than time its own, or a plan
    that followed "blocked" is measured against an "sdpa" step (11% apart at tiny's size)."""
    planned = resolve(cfg, resolve_device(cfg.train.device), timed=False).config
    return dataclasses.replace(
        cfg,
        model=dataclasses.replace(cfg.model, attention=planned.model.attention),
        train=dataclasses.replace(cfg.train, compile="none", loss_kernel=planned.train.loss_kernel),
        memory=dataclasses.replace(cfg.memory, loss_chunk=planned.memory.loss_chunk),
    )


def measure_real_step(cfg: Config) -> tuple[Built, dict[str, Any]]:
    """Two steps on random tokens (the first creates optimizer states), the second measured,
    running the kernels the planner follows (planned_kernels)."""
    built = build(planned_kernels(cfg), with_data=False)
    tokens = torch.randint(0, cfg.model.vocab_size, (cfg.train.batch_size, cfg.train_seq_len + 1))
    x, y = tokens[:, :-1], tokens[:, 1:]
    if built.classes:
        y = classification_targets(x, built.classes)
    n = count_targets(y)
    positions = placeholder_positions(cfg.data.packing, *x.shape)
    built.step(x, y, n, 0, positions)
    _, memory = measure_step(built, x, y, n, 1, positions)
    return built, memory
