"""What a step would cost without one of its parts, or with other arithmetic:
`ONEGPU_WHAT_IF=gelu,layernorm,optimizer,exp_u20` changes each named part in any Python process
started with this folder on PYTHONPATH (benchmarks/step_cuts.py's `free-*` and `fast-exp`
cuts). An ablation, not training: the model it runs is not the model asked for, and its loss
shows it.

- gelu: the MLP's activation is the identity (nothing computed, nothing saved for backward);
- layernorm: every LayerNorm returns its input (its weight and bias get no gradient);
- optimizer: no gradient norm, clipping or optimizer step; the gradients are still freed;
- exp_u20: inductor's vectorised CPU kernels call ATen's faster `exp_u20` where they call
  Sleef's 1-ulp exponential (the sigmoid's included): other bits. Its kernels must be generated
  anew, so the cut turns inductor's caches off for the process.

A part's cost in the step is then the step's time less the what-if's, timed in turns: what the
step would gain if that part ran in no time, not what the profile's self time says it costs
(a kernel's neighbours change when it goes).
"""

from __future__ import annotations

import os

PARTS = ("gelu", "layernorm", "optimizer", "exp_u20")

_asked = [p for p in os.environ.get("ONEGPU_WHAT_IF", "").split(",") if p]
if _asked:
    unknown = sorted(set(_asked) - set(PARTS))
    if unknown:
        raise SystemExit(f"ONEGPU_WHAT_IF: unknown part(s) {unknown}; use any of {PARTS}")
    import torch

    import onegpu.models.gpt as gpt
    from onegpu.backends.torch.step import TrainStep

    if "gelu" in _asked:
        gpt.tanh_gelu_sigmoid_form = lambda x: x  # what a compiled block traces
        gpt.TanhGELU.forward = lambda self, x: x  # and an eager one runs
    if "layernorm" in _asked:
        gpt.LayerNorm.forward = lambda self, x: x
    if "optimizer" in _asked:

        def _no_step(self: TrainStep, loss: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            self.optimizer.zero_grad(set_to_none=True)
            return loss.new_zeros(()), torch.zeros((), dtype=torch.bool, device=loss.device)

        TrainStep._clip_and_step = _no_step
    if "exp_u20" in _asked:
        from torch._inductor.codegen import cpp

        cpp.CppVecOverrides.exp = staticmethod(lambda x: f"{x}.exp_u20()")
        cpp.CppVecOverrides.sigmoid = staticmethod(
            lambda x: f"decltype({x})(1)/(decltype({x})(1) + {x}.neg().exp_u20())"
        )
