"""What a step would cost without one of its parts, or with other arithmetic:
`ONEGPU_WHAT_IF=gelu,layernorm,optimizer,exp_u20` changes each named part in any Python process
started with this folder on PYTHONPATH (benchmarks/step_cuts.py's `free-*` and `fast-exp`
cuts). An ablation, not training: the model it runs is not the model asked for, and its loss
shows it.

- gelu: the MLP's activation is the identity (nothing computed, nothing saved for backward);
- layernorm: every LayerNorm returns its input (its weight and bias get no gradient);
- optimizer: no gradient norm, clipping or optimizer step; the gradients are still freed
  (the optimizer-in-backward path is not covered);
- exp_u20: inductor's vectorised CPU `exp` and `sigmoid` call ATen's faster `exp_u20` where
  they call Sleef's 1-ulp exponential (other bits; scalar tails, `tanh` and `expm1` unchanged).
  Kernels already in inductor's caches would be reused unchanged: turn them off
  (step_cuts.py's `fast-exp` cut does).

Python's `site` prints and ignores an error raised here, which would leave the step whole
under a what-if's name: every failure, a patch whose target has moved included, exits instead.
"""

from __future__ import annotations

import os
from typing import Any

PARTS = ("gelu", "layernorm", "optimizer", "exp_u20")


def _refuse(why: str) -> None:
    raise SystemExit(f"ONEGPU_WHAT_IF: {why}")


def _replace(owner: Any, name: str, value: Any) -> None:
    """`owner.name = value`, refused where `owner` has no such attribute (a renamed target
    would otherwise get an unused one, and the what-if would time the step unchanged)."""
    if not hasattr(owner, name):
        _refuse(f"{getattr(owner, '__name__', owner)!s} has no {name!r} to replace")
    setattr(owner, name, value)


def _apply(asked: list[str]) -> None:
    import torch

    import onegpu.models.gpt as gpt
    from onegpu.backends.torch.step import TrainStep

    if "gelu" in asked:  # eager and compiled blocks both call TanhGELU.forward
        _replace(gpt.TanhGELU, "forward", lambda self, x: x)
    if "layernorm" in asked:
        _replace(gpt.LayerNorm, "forward", lambda self, x: x)
    if "optimizer" in asked:

        def no_step(self: TrainStep, loss: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            self.optimizer.zero_grad(set_to_none=True)
            return loss.new_zeros(()), torch.zeros((), dtype=torch.bool, device=loss.device)

        _replace(TrainStep, "_clip_and_step", no_step)
    if "exp_u20" in asked:
        from torch._inductor.codegen import cpp

        ops = cpp.CppVecOverrides
        _replace(ops, "exp", staticmethod(lambda x: f"{x}.exp_u20()"))
        sigmoid = staticmethod(
            lambda x: f"decltype({x})(1)/(decltype({x})(1) + {x}.neg().exp_u20())"
        )
        _replace(ops, "sigmoid", sigmoid)


def _main() -> None:
    asked = [p for p in os.environ.get("ONEGPU_WHAT_IF", "").split(",") if p]
    if not asked:
        return
    unknown = sorted(set(asked) - set(PARTS))
    if unknown:
        _refuse(f"unknown part(s) {unknown}; use any of {PARTS}")
    try:
        _apply(asked)
    except SystemExit:
        raise
    except Exception as e:  # noqa: BLE001 - any failure: exit, never time the step unchanged
        _refuse(f"could not apply {asked}: {type(e).__name__}: {e}")


_main()
