"""What a step would cost without one of its parts, or with other arithmetic: `ONEGPU_WHAT_IF=`
any of PARTS, comma-separated, changes each named part in any Python process started with this
folder on PYTHONPATH (benchmarks/step_cuts.py's `free-*`, `ftz` and `fast-exp` cuts). An
ablation, not training: the model it runs is not the model asked for, and its loss shows it.

- gelu: the MLP's activation is the identity (nothing computed, nothing saved for backward);
- layernorm: every LayerNorm returns its input (its weight and bias get no gradient);
- optimizer: no gradient norm, clipping or optimizer step; the gradients are still freed
  (the optimizer-in-backward path is not covered);
- attention-softmax: blocked attention's causal softmax returns its scores scaled to about a
  probability's size (times scale / keys) and cast: one elementwise pass where the softmax
  makes several, no mask; its backward still runs. (Times zero would not do: inductor folds
  that to zeros and drops the scores' product, a part of the floor, with it.)
- loss-softmax: the chunked loss's C++ softmax gradient returns a zero loss and a zero gradient
  of the chunk's shape (the allocation and its fill kept; zeros, so nothing upstream diverges);
- ftz: denormal inputs read as zero and denormal results flushed to zero
  (`torch.set_flush_denormal`, before any thread starts: torch's threads inherit it), where
  the CPU offers it: other bits wherever a value of the step is denormal;
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

PARTS = ("gelu", "layernorm", "optimizer", "attention-softmax", "loss-softmax", "exp_u20", "ftz")


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
    if "attention-softmax" in asked:
        import onegpu.models.blocked_attention as blocked

        def scaled(scores, start, scale, dtype):  # noqa: ANN001, ANN202
            # not x * 0: inductor folds that to zeros and drops the scores' product with it
            return scores.mul(scale / scores.shape[-1]).to(dtype)

        _replace(blocked, "causal_softmax", scaled)
    if "loss-softmax" in asked:
        from onegpu.techniques import loss_kernel_cpu

        def no_softmax(logits, safe_t, valid_c1, n_valid, out_dtype):  # noqa: ANN001, ANN202
            return logits.new_zeros((), dtype=torch.float32), torch.zeros_like(
                logits, dtype=out_dtype
            )

        _replace(loss_kernel_cpu, "softmax_grad", no_softmax)
    if "ftz" in asked and not torch.set_flush_denormal(True):
        _refuse("this CPU cannot flush denormals (torch.set_flush_denormal)")
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
