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
from collections.abc import Callable, Iterator
from typing import Any

import torch


class PerParameterOptimizers:
    """One small optimizer per parameter, sharing the hyper-parameters of its group, so that
    each parameter can step alone as soon as its gradient is whole (on the device here, or on
    the host: offload/host_optimizer.py). Looks like an optimizer to the trainer: param_groups
    for the LR schedule, state, state_dict; `step` and `zero_grad` are no-ops."""

    steps_in_backward = True

    def __init__(
        self,
        groups: list[dict[str, Any]],
        make_optimizer: Callable[[list[dict[str, Any]]], torch.optim.Optimizer],
    ):
        self._optimizers: dict[torch.Tensor, torch.optim.Optimizer] = {}
        for group in groups:
            for p in group["params"]:
                self._optimizers[p] = make_optimizer([{**group, "params": [p]}])
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
        """Step `p` on its gradient, counted into the norm `pop_grad_norm` returns."""
        sq = p.grad.float().pow(2).sum()
        self._sq_norm = sq if self._sq_norm is None else self._sq_norm + sq
        self._optimizers[p].step()

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
        return {"per_parameter": [opt.state_dict() for opt in self._optimizers.values()]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for opt, s in zip(self._optimizers.values(), state["per_parameter"], strict=True):
            opt.load_state_dict(s)


class OptimizerInBackward(PerParameterOptimizers):
    """Each device parameter steps in the backward that completes its gradient, which is then
    freed."""

    def __init__(
        self,
        groups: list[dict[str, Any]],
        make_optimizer: Callable[[list[dict[str, Any]]], torch.optim.Optimizer],
    ):
        super().__init__(groups, make_optimizer)
        for p in self._optimizers:
            p.register_post_accumulate_grad_hook(self._step_and_free)

    @torch.no_grad()
    def _step_and_free(self, p: torch.Tensor) -> None:
        if self.stepping:
            self.step_param(p)
            p.grad = None
