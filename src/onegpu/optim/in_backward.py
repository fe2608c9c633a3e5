"""The optimizer step fused into backward: each parameter is updated, and its gradient freed,
as soon as autograd has finished accumulating it.

Full gradients then never coexist: the step holds at most the gradients still in flight
instead of one per parameter (the "gradients" row of Hugging Face's "Efficient Training on a
Single GPU" drops from 4 bytes/parameter to about the largest layer's). With gradient
accumulation (which torchtune never allowed with it, its issue #794) the micro-batches before
the last only accumulate (`accumulating()`), and each parameter steps in the last one's
backward: the whole batch's gradients live between micro-batches, as in any accumulation, and
the optimizer step's own temporaries never do. The price: no clipping by global norm (it needs
every gradient at once) and no fp16 loss scaling (its inf check needs them too); the config
refuses those. Built on the public `Tensor.register_post_accumulate_grad_hook` (PyTorch's
"optimizer in backward" recipe): one small optimizer per parameter, sharing the
hyper-parameters of its group.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from onegpu.offload.host_states import HostStates


SLICE_ELEMENTS = 1 << 26
"""A parameter larger than this (an 8B model's 525M-element embedding and output layer) steps
in slices of rows under an elementwise optimizer: its step's temporaries (torchao's 8-bit step
holds both moments in fp32, 8 bytes an element) and, in host memory, the states in flight are
a slice's, not the whole tensor's."""

ELEMENTWISE = {"adamw": 1, "sgd": 1, "adamw8bit": 256, "adamw4bit": 128}
"""Optimizers whose step is elementwise, so a slice steps as the whole tensor would, bit for
bit: each with the block its states are quantized in, which a slice must not cut."""


def row_slices(p: torch.Tensor, limit: int, block: int) -> list[tuple[int, int]]:
    """Row ranges of `p` of at most `limit` elements, each a whole number of `block`s (one
    range, the whole tensor, where it is small, 1-D or its rows cannot be cut so)."""
    if p.ndim < 2 or p.numel() <= limit:
        return [(0, p.shape[0] if p.ndim else 1)]
    row = p.numel() // p.shape[0]
    step = block // math.gcd(row, block)  # rows that make whole blocks
    rows = limit // row // step * step
    if rows == 0:
        return [(0, p.shape[0])]
    return [(a, min(a + rows, p.shape[0])) for a in range(0, p.shape[0], rows)]


class PerParameterOptimizers:
    """One small optimizer per parameter, sharing the hyper-parameters of its group, so that
    each parameter can step alone as soon as its gradient is whole (on the device here, or on
    the host: offload/host_optimizer.py). Looks like an optimizer to the trainer: param_groups
    for the LR schedule, state, state_dict; `step` and `zero_grad` are no-ops. With `states`
    (memory.offload_states) each parameter's states wait in host memory between its steps.
    `slice_block`: the optimizer is elementwise with states in blocks of this many elements,
    so a large parameter steps in slices (`SLICE_ELEMENTS`)."""

    steps_in_backward = True

    def __init__(
        self,
        groups: list[dict[str, Any]],
        make_optimizer: Callable[[list[dict[str, Any]]], torch.optim.Optimizer],
        *,
        states: HostStates | None = None,
        slice_block: int | None = None,
    ):
        self.states = states
        # parameter -> what steps: itself, or slices of its rows (a view, and which rows)
        self._pieces: dict[torch.Tensor, list[tuple[torch.Tensor, slice | None]]] = {}
        self._optimizers: dict[torch.Tensor, torch.optim.Optimizer] = {}  # one per piece
        for group in groups:
            for p in group["params"]:
                self._pieces[p] = _pieces(p, slice_block)
                for piece, _ in self._pieces[p]:
                    self._optimizers[piece] = make_optimizer([{**group, "params": [piece]}])
        self._sq_norm: torch.Tensor | None = None
        self._stepping = True

    @contextlib.contextmanager
    def accumulating(self) -> Iterator[None]:
        """A backward inside only accumulates gradients (a micro-batch before the last)."""
        self._stepping = False
        try:
            yield
        finally:
            self._stepping = True

    @property
    def stepping(self) -> bool:
        """Whether a gradient made now is whole (the last micro-batch's backward)."""
        return self._stepping

    @torch.no_grad()
    def step_param(self, p: torch.Tensor) -> None:
        """Step `p` on its gradient, a slice at a time where it is sliced; in backward,
        counted into the norm `pop_grad_norm` returns (after backward the trainer takes the
        norm itself)."""
        if self.steps_in_backward:
            # in fp32 without an fp32 copy of the gradient (2 GiB for an 8B model's head)
            sq = torch.linalg.vector_norm(p.grad, dtype=torch.float32).square()
            self._sq_norm = sq if self._sq_norm is None else self._sq_norm + sq
        for piece, rows in self._pieces[p]:
            if rows is not None:  # a view of p's rows: the same rows of its gradient
                piece.grad = p.grad[rows]
            optimizer = self._optimizers[piece]
            if self.states is None:
                optimizer.step()
            else:
                with self.states.visiting(piece, optimizer):
                    optimizer.step()
            if rows is not None:
                piece.grad = None

    def pop_grad_norm(self) -> torch.Tensor:
        """Global L2 norm of the gradients stepped since the last call."""
        sq, self._sq_norm = self._sq_norm, None
        return torch.zeros(()) if sq is None else sq.sqrt()

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        """The inner optimizers' groups, read live (load_state_dict replaces those dicts)."""
        return [g for opt in self._optimizers.values() for g in opt.param_groups]

    @property
    def state(self) -> dict[torch.Tensor, dict[str, Any]]:
        return {p: s for opt in self._optimizers.values() for p, s in opt.state.items()}

    def step(self, closure=None) -> None:
        """Nothing to do: every parameter was stepped in backward."""

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Nothing to do: every gradient was freed after its step."""

    def state_dict(self) -> dict[str, Any]:
        if self.states is not None:  # the copies back to the host are done
            self.states.synchronize()
        return {"per_parameter": [opt.state_dict() for opt in self._optimizers.values()]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Each parameter's states as saved (torch loads them onto the parameter's device; in
        host memory, they go there one parameter at a time)."""
        pairs = zip(self._optimizers.items(), state["per_parameter"], strict=True)
        for (p, opt), saved in pairs:
            opt.load_state_dict(saved)
            if self.states is not None:
                self.states.park_loaded(p, opt)


class OneParameterAtATime(PerParameterOptimizers):
    """The states in host memory without optim.in_backward: after backward (and clipping),
    each parameter steps alone, so that one parameter's states at a time are on the device."""

    steps_in_backward = False

    def step(self, closure=None) -> None:
        for p in self._pieces:
            if p.grad is not None:
                self.step_param(p)

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self._pieces:
            p.grad = None


class OptimizerInBackward(PerParameterOptimizers):
    """Each device parameter steps in the backward that completes its gradient, which is then
    freed."""

    def __init__(
        self,
        groups: list[dict[str, Any]],
        make_optimizer: Callable[[list[dict[str, Any]]], torch.optim.Optimizer],
        *,
        states: HostStates | None = None,
        slice_block: int | None = None,
    ):
        super().__init__(groups, make_optimizer, states=states, slice_block=slice_block)
        for p in self._pieces:
            p.register_post_accumulate_grad_hook(self._step_and_free)

    @torch.no_grad()
    def _step_and_free(self, p: torch.Tensor) -> None:
        if self.stepping:
            self.step_param(p)
            p.grad = None


def _pieces(p: torch.Tensor, block: int | None) -> list[tuple[torch.Tensor, slice | None]]:
    """What steps for `p`: itself, or (an elementwise optimizer, a large parameter) views of
    its rows, which step it in place, each with the rows of the gradient it takes."""
    ranges = row_slices(p, SLICE_ELEMENTS, block) if block else [(0, 0)]
    if len(ranges) == 1:
        return [(p, None)]
    return [(p.detach()[a:b], slice(a, b)) for a, b in ranges]
