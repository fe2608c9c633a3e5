"""CUDA's autocast rules, applied to a plan's fake tensors, which are CPU tensors.

A plan for a GPU runs its step under the CPU's autocast (plan/memory.py). The two agree on the
matmuls, which both run in 16 bits, but not on the ops that CUDA's autocast keeps in fp32: on
CUDA a LayerNorm, a softmax or a sum given a bf16 tensor runs on an fp32 copy of it (or returns
fp32), while the CPU's autocast leaves it in bf16. Where a step feeds such ops 16-bit tensors
(bf16-pure: the weights and the residual stream are bf16), the GPU saves fp32 copies the CPU
never makes. GPT-2 124M, bf16-pure, batch 8 x 1024 on an H200: 4.28 GiB measured, 3.60 planned
under the CPU's rules, 4.26 under these (benchmarks/results/gpu-nvidia-h200-2026-11-28-2.md;
docs/gpu-suite.md).

The op lists are torch's (aten/src/ATen/autocast_mode.h: AT_FORALL_FP32 and
AT_FORALL_FP32_SET_OPT_DTYPE), by the Python name that reaches them. Only ops a Python call
reaches directly are seen: a composite's inner ops (`F.rms_norm`'s `pow`) keep the CPU's rules.
"""

from __future__ import annotations

import contextlib
from collections import Counter
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

_NORMS = {"layer_norm", "native_layer_norm", "group_norm", "renorm"}
_POINTWISE = {"exp", "expm1", "log", "log10", "log2", "log1p", "reciprocal", "rsqrt", "erfinv"}
_POWERS = {"pow", "__pow__", "__rpow__", "softplus", "acos", "asin", "cosh", "sinh", "tan"}
_LOSSES = {"nll_loss", "kl_div", "l1_loss", "smooth_l1_loss", "huber_loss", "mse_loss"}
_OTHERS = {"binary_cross_entropy_with_logits", "cosine_similarity", "dist", "pdist", "cdist"}
FP32 = frozenset(_NORMS | _POINTWISE | _POWERS | _LOSSES | _OTHERS | {"logsumexp"})
"""Run in fp32: every 16-bit floating-point argument is cast to an fp32 copy first."""
FP32_OUTPUT = frozenset({"softmax", "log_softmax", "sum", "cumsum", "prod", "cumprod"})
"""Given no dtype, computed into fp32 (`dtype=torch.float32`): the output is fp32."""
SIXTEEN_BIT = (torch.bfloat16, torch.float16)


def _fp32(value: Any) -> Any:
    if isinstance(value, torch.Tensor) and value.dtype in SIXTEEN_BIT:
        return value.float()
    if isinstance(value, (list, tuple)):
        return type(value)(_fp32(v) for v in value)
    return value


class CudaAutocastRules(TorchFunctionMode):
    """Under the CPU's autocast, what CUDA's would do to the ops it keeps in fp32; `applied`
    counts them by name."""

    def __init__(self) -> None:
        super().__init__()
        self.applied: Counter[str] = Counter()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if name in FP32 and _under_autocast(*args, *kwargs.values()):
            self.applied[name] += 1
            args = tuple(_fp32(a) for a in args)
            kwargs = {k: _fp32(v) for k, v in kwargs.items()}
        elif name in FP32_OUTPUT and kwargs.get("dtype") is None and _under_autocast(*args[:1]):
            self.applied[name] += 1
            kwargs = {**kwargs, "dtype": torch.float32}
        return func(*args, **kwargs)


def _under_autocast(*values: Any) -> bool:
    """A 16-bit tensor among `values` (or in a list of them), under the plan's autocast."""
    flat = [v for value in values for v in (value if isinstance(value, (list, tuple)) else [value])]
    sixteen = any(isinstance(v, torch.Tensor) and v.dtype in SIXTEEN_BIT for v in flat)
    return sixteen and torch.is_autocast_enabled("cpu")


def autocast_rules(target: str) -> contextlib.AbstractContextManager:
    """The target's autocast rules over the CPU's: CUDA's for a GPU plan, none for a CPU's."""
    return CudaAutocastRules() if target == "cuda" else contextlib.nullcontext()
