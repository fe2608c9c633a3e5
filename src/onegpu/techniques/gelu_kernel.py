"""GPT-2's tanh GELU as two inductor kernels where the model runs eagerly (`train.gelu_kernel`).

ATen's tanh GELU passes over the MLP's [tokens, 4 x d_model] activation once forward and once
backward, as a fused kernel should; what it costs is its vectorised tanh, which differs by CPU.
On the 2-core AMX-BF16 Xeon, at model B's 4,096 x 1,536 in bf16, it took 11.0 ms forward and
11.3 ms backward, where the erf GELU takes 2.3 ms and torch.tanh over fp32 2.8 ms. Compiled in
its sigmoid form (models/gpt.py's `tanh_gelu_sigmoid_form`, the same function), forward and
backward ran in 4.3 and 5.1 ms: 78 ms a step over B's 6 layers
(benchmarks/results/gelu-kernels-2026-12-06.md, a slow hour of that VM). A compiled model (blocks or
whole) fuses the same form into its graph already; this is the eager path's share of it.

The backward kernel recomputes the sigmoid from the saved input, as ATen's does: what is saved
for backward (the input) and what is allocated (the output, then the input's gradient) are
the same as ATen's, so a plan follows ATen's kernel unchanged. `auto`
(`resolve_gelu_kernel`) times both once per shape and device and compiles where the saving
over the run's calls outweighs the compile time (techniques/kernel_trial.py's rule).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from onegpu.models.gpt import TanhGELU, tanh_gelu_sigmoid_form
from onegpu.perf.allocator import active_allocator
from onegpu.perf.devices import device_key, sync
from onegpu.techniques.kernel_trial import missing_compiler, resolve, time_both

CACHE = "gelu_kernel.json"
_U = math.sqrt(2 / math.pi)
_CUBIC = 0.044715


def tanh_gelu_grad(g: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """d GELU / dx times `g`, from the input, in fp32 and cast back to `g`'s dtype: with
    s = sigmoid(2u), GELU = x s and its derivative is s + x s (1 - s) 2u'."""
    x32 = x.float()
    s = torch.sigmoid((2 * _U) * (x32 + _CUBIC * x32 * x32 * x32))
    du2 = (2 * _U) * (1 + 3 * _CUBIC * x32 * x32)
    return (g.float() * s * (1 + x32 * (1 - s) * du2)).to(g.dtype)


_COMPILED: list[tuple[Callable, Callable]] = []


def _kernels() -> tuple[Callable, Callable]:
    """Forward and backward compiled (lazily, on first call), whole graphs or an error: a graph
    break would run part of them eagerly without a word. Shapes are left to dynamo (a second
    shape compiles one dynamic kernel): elementwise kernels lose nothing to it, and a process
    that meets many shapes (a trial, training, evaluation, several models) never runs into
    the recompile limit, which a whole-graph compile turns into an error."""
    if not _COMPILED:
        _COMPILED.append(
            (
                torch.compile(tanh_gelu_sigmoid_form, fullgraph=True),
                torch.compile(tanh_gelu_grad, fullgraph=True),
            )
        )
    return _COMPILED[0]


class CompiledTanhGELU(torch.autograd.Function):
    """The tanh GELU through the compiled kernels; saves its input, as ATen's does."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x)
        return _kernels()[0](x)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> torch.Tensor:
        (x,) = ctx.saved_tensors
        return _kernels()[1](g.contiguous(), x)


def compiled_gelu(x: torch.Tensor) -> torch.Tensor:
    return CompiledTanhGELU.apply(x)


def use_gelu_kernel(model: nn.Module, name: str) -> int:
    """Every TanhGELU of `model` on the kernel `train.gelu_kernel` resolved to ('compiled' or
    'eager'); returns how many there are."""
    gelus = [m for m in model.modules() if isinstance(m, TanhGELU)]
    for gelu in gelus:
        gelu.kernel = compiled_gelu if name == "compiled" else None
    return len(gelus)


@dataclass(frozen=True, slots=True)
class GeluShape:
    """The activation one GELU call of a micro-batch sees: what its timing depends on."""

    tokens: int
    hidden: int
    dtype: torch.dtype

    def key(self, device: torch.device) -> str:
        return (
            f"{device_key(device)}|{active_allocator()}|{self.dtype}"
            f"|tokens={self.tokens}|hidden={self.hidden}"
        )


def measure_gelu_kernel(shape: GeluShape, device: torch.device) -> dict[str, Any]:
    """One GELU call's forward + backward on random inputs of `shape`, ATen's and compiled
    (kernel_trial.time_both)."""
    gen = torch.Generator(device="cpu").manual_seed(0)
    x = torch.randn(shape.tokens, shape.hidden, generator=gen).to(device, shape.dtype)
    g = torch.randn(shape.tokens, shape.hidden, generator=gen).to(device, shape.dtype)
    x.requires_grad_()

    def run(compiled: bool) -> float:
        sync(device)
        t0 = time.perf_counter()
        y = compiled_gelu(x) if compiled else F.gelu(x, approximate="tanh")
        y.backward(g)
        sync(device)
        x.grad = None
        return time.perf_counter() - t0

    return time_both(run)


def resolve_gelu_kernel(
    value: str,
    shape: GeluShape,
    device: torch.device,
    calls: int,
    *,
    skipped: str = "",
    timed: bool = True,
) -> tuple[str, dict[str, Any] | None]:
    """(what `train.gelu_kernel` stands for, what it was decided by): see kernel_trial.resolve.
    `calls`: GELU calls over the run (micro-batches x layers); `skipped`: why the caller knows
    the kernel cannot matter (a compiled model, no GELU of ours, a GPU, a short run)."""
    return resolve(
        "train.gelu_kernel",
        value,
        calls,
        cache=CACHE,
        key=lambda: shape.key(device),
        measure=lambda: measure_gelu_kernel(shape, device),
        compiler_missing=lambda: missing_compiler(device),
        skipped=skipped,
        timed=timed,
    )
