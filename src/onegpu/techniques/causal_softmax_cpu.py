"""Blocked attention's causal softmax on a CPU: a C++ kernel of onegpu's own
(`csrc/causal_softmax.cpp`), registered as the CPU kernel of `onegpu::causal_softmax`
(models/blocked_attention.py), eager and compiled alike (inductor calls the op as it is).

Why: ATen's ops for a query block's softmax (the mask's add, the softmax, the cast to bf16) each
read and write the block's fp32 scores; on 2 AMX cores they took 25 ms a step of model B
(12 softmax, 9 add, 4 cast; `onegpu profile`, docs/floor.md). The kernel does them in one pass
a row, the row's logits in a buffer that stays in cache, with ATen's arithmetic step by step:
the same bits (tests/techniques/test_causal_softmax_cpu.py). Where it does not build, ATen's ops
run, as before.
"""

from __future__ import annotations

import functools
from types import ModuleType

import torch

from onegpu.models.blocked_attention import aten_causal_softmax
from onegpu.techniques import cpu_extension

DTYPES = (torch.bfloat16, torch.float32)


@functools.cache
def built() -> bool:
    """Whether the kernel builds here (said once where it does not)."""
    return cpu_extension.builds(
        extension, "attention softmax", "ATen's ops compute blocked attention's softmax instead"
    )


def extension() -> ModuleType:
    return cpu_extension.load("causal_softmax")


def causal_softmax(
    scores_BHRS: torch.Tensor, start: int, scale: float, out_dtype: torch.dtype
) -> torch.Tensor:
    """The op's CPU kernel: the C++ one for fp32 scores into bf16 or fp32, else ATen's."""
    if scores_BHRS.dtype == torch.float32 and out_dtype in DTYPES and built():
        to_bf16 = out_dtype == torch.bfloat16
        return extension().causal_softmax(scores_BHRS, start, scale, to_bf16)
    return aten_causal_softmax(scores_BHRS, start, scale, out_dtype)


@functools.cache
def register() -> None:
    """Make the C++ kernel `onegpu::causal_softmax`'s CPU kernel (once; it builds on first call)."""
    torch.library.register_kernel("onegpu::causal_softmax", "cpu", causal_softmax)
