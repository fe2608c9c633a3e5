"""Approximate-gradient layers: few-bit GELU and randomized linear backward, from Gusak,
"Neural Networks Memory Footprint Reduction during Training" (Skoltech, 2022).

Few-bit GELU (`memory.gelu_bits` = k in 1..4): forward is the exact GELU; instead of its input
(2-4 bytes per element), backward keeps only a k-bit code of which of 2^k intervals the input
fell in, and multiplies the incoming gradient by a constant per interval: a piecewise-constant
approximation of GELU's derivative with optimised breakpoints (Novikov et al., "Few-Bit Backward: Quantized Gradients of Activation Functions", Fig. 1). The codes are
bit-packed, so the saved bytes really are k/8 per element.

Randomized linear (`memory.randomized_linear` = kept fraction r in (0, 1)): a linear layer saves
S^T X (r*N rows instead of N) and a PRNG seed instead of its input X; backward regenerates S and
estimates dW = dY^T S S^T X, unbiased because E[S S^T] = I (Bershatsky et al., "Memory-Efficient Backpropagation through Large Linear Layers",
Algorithm 1). dX is exact.
"""

from __future__ import annotations

import functools
import math

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from onegpu.config import ConfigError

# ---------------------------------------------------------------------------- few-bit GELU


def gelu_tanh_derivative(x: np.ndarray) -> np.ndarray:
    c = math.sqrt(2 / math.pi)
    u = c * (x + 0.044715 * x**3)
    t = np.tanh(u)
    return 0.5 * (1 + t) + 0.5 * x * (1 - t**2) * c * (1 + 3 * 0.044715 * x**2)


def gelu_erf_derivative(x: np.ndarray) -> np.ndarray:
    """d/dx x * Phi(x) = Phi(x) + x * phi(x) (the exact GELU of BERT and others)."""
    erf = np.vectorize(math.erf)
    return 0.5 * (1 + erf(x / math.sqrt(2))) + x * np.exp(-0.5 * x**2) / math.sqrt(2 * math.pi)


@functools.lru_cache(maxsize=16)
def gelu_derivative_levels(
    bits: int, approximate: str = "tanh"
) -> tuple[np.ndarray, np.ndarray, float]:
    """Breakpoints (2^bits - 1) and levels (2^bits) of a piecewise-constant approximation q of
    GELU'(x) minimising E[(GELU'(x) - q(x))^2] for x ~ N(0, 1) (pre-activations are roughly
    normal), by Lloyd iterations on a fine grid; and sup |GELU'(x) - q(x)| over the real line
    (tails included), the per-element bound on the relative gradient error."""
    n = 2**bits
    grid = np.linspace(-10, 10, 40001)
    g = gelu_tanh_derivative(grid) if approximate == "tanh" else gelu_erf_derivative(grid)
    w = np.exp(-0.5 * grid**2)
    breaks = np.quantile(
        np.random.default_rng(0).standard_normal(200_000), np.linspace(0, 1, n + 1)[1:-1]
    )
    for _ in range(500):
        idx = np.searchsorted(breaks, grid)
        levels = np.array([np.average(g[idx == i], weights=w[idx == i]) for i in range(n)])
        new = breaks.copy()
        for i in range(n - 1):  # optimal boundary: where g crosses the mean of its two levels
            mid = 0.5 * (levels[i] + levels[i + 1])
            cross = np.nonzero(np.diff(np.sign(g - mid)))[0]
            if len(cross):
                new[i] = grid[cross[np.argmin(np.abs(grid[cross] - breaks[i]))]]
        new = np.sort(new)
        if np.allclose(new, breaks):
            break
        breaks = new
    max_err = max(
        float(np.abs(g - levels[np.searchsorted(breaks, grid, side=side)]).max())
        for side in ("left", "right")
    )
    return breaks.astype(np.float32), levels.astype(np.float32), max_err


def pack_bits(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack integer codes < 2^bits into bytes: 8 codes in `bits` bytes."""
    flat = codes.flatten().to(torch.int64)
    flat = F.pad(flat, (0, (-flat.numel()) % 8)).view(-1, 8)
    shifts = torch.arange(8, device=codes.device) * bits
    word = (flat << shifts).sum(dim=1)  # 8 * bits <= 32 bits
    byte_shifts = torch.arange(bits, device=codes.device) * 8
    return ((word.unsqueeze(1) >> byte_shifts) & 0xFF).to(torch.uint8)


def unpack_bits(packed: torch.Tensor, bits: int, numel: int) -> torch.Tensor:
    byte_shifts = torch.arange(bits, device=packed.device) * 8
    word = (packed.to(torch.int64) << byte_shifts).sum(dim=1)
    shifts = torch.arange(8, device=packed.device) * bits
    codes = (word.unsqueeze(1) >> shifts) & (2**bits - 1)
    return codes.flatten()[:numel]


class _FewBitGELU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, bits: int, breaks: torch.Tensor, levels: torch.Tensor, approximate: str):
        codes = torch.bucketize(x.detach().float(), breaks, right=True)
        ctx.save_for_backward(pack_bits(codes, bits), levels)
        ctx.bits, ctx.shape = bits, x.shape
        return F.gelu(x, approximate=approximate)

    @staticmethod
    def backward(ctx, grad_y):
        packed, levels = ctx.saved_tensors
        codes = unpack_bits(packed, ctx.bits, grad_y.numel()).view(ctx.shape)
        return grad_y * levels[codes].to(grad_y.dtype), None, None, None, None


class FewBitGELU(nn.Module):
    """GELU (`approximate` 'tanh' as GPT-2, or 'none': the exact erf form) whose backward keeps
    a `bits`-bit code of the input."""

    def __init__(self, bits: int, approximate: str = "tanh"):
        super().__init__()
        self.bits, self.approximate = bits, approximate
        breaks, levels, self.max_derivative_error = gelu_derivative_levels(bits, approximate)
        self._breaks, self._levels = torch.from_numpy(breaks), torch.from_numpy(levels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._breaks.device != x.device:  # plain tensors, not buffers: meta-build friendly
            self._breaks, self._levels = self._breaks.to(x.device), self._levels.to(x.device)
        return _FewBitGELU.apply(x, self.bits, self._breaks, self._levels, self.approximate)

    def extra_repr(self) -> str:
        return f"bits={self.bits}, approximate={self.approximate!r}"


# ---------------------------------------------------------------------------- randomized linear


class _RandomizedLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, keep: float, seed: int):
        x2 = x.reshape(-1, x.shape[-1])
        n = x2.shape[0]
        k = max(1, math.ceil(keep * n))
        S = _sketch(n, k, seed, x2)
        ctx.save_for_backward(S.T @ x2, weight)  # [k, in] instead of [n, in]
        ctx.meta = (x.shape, n, k, seed, bias is not None)
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, grad_y):
        x_proj, weight = ctx.saved_tensors
        x_shape, n, k, seed, has_bias = ctx.meta
        g2 = grad_y.reshape(n, -1)
        S = _sketch(n, k, seed, x_proj)
        grad_w = (g2.T @ S) @ x_proj  # unbiased: E[S S^T] = I
        grad_x = (g2 @ weight.to(g2.dtype)).view(x_shape)
        grad_b = g2.sum(0) if has_bias else None
        return grad_x, grad_w.to(weight.dtype), grad_b, None, None


def _sketch(n: int, k: int, seed: int, like: torch.Tensor) -> torch.Tensor:
    """S in R^{n x k}, entries N(0, 1/k): regenerated from the seed, never stored."""
    g = torch.Generator(device=like.device).manual_seed(seed)
    return (torch.randn(n, k, generator=g, device=like.device) / math.sqrt(k)).to(like.dtype)


class RandomizedLinear(nn.Linear):
    """nn.Linear whose weight gradient is a randomized (unbiased) estimate; same parameters."""

    keep: float = 1.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or not torch.is_grad_enabled():
            return super().forward(x)
        seed = int(
            torch.randint(0, 2**62, (1,)).item()
        )  # global RNG: reproducible, checkpoint-safe
        dtype = (
            torch.get_autocast_dtype(x.device.type)
            if torch.is_autocast_enabled(x.device.type)
            else x.dtype
        )
        with torch.autocast(x.device.type, enabled=False):
            bias = self.bias.to(dtype) if self.bias is not None else None
            return _RandomizedLinear.apply(
                x.to(dtype), self.weight.to(dtype), bias, self.keep, seed
            )


# ---------------------------------------------------------------------------- applying


# transformers' GELU modules (transformers/activations.py) -> the F.gelu form they compute
_HF_GELUS = {
    "GELUActivation": "none",
    "NewGELUActivation": "tanh",
    "GELUTanh": "tanh",
    "PytorchGELUTanh": "tanh",
    "FastGELUActivation": "tanh",
}


def gelu_form(module: nn.Module) -> str | None:
    """'tanh' or 'none' if `module` is a GELU whose forward F.gelu reproduces, else None."""
    if isinstance(module, nn.GELU):  # onegpu's TanhGELU included
        return module.approximate
    return _HF_GELUS.get(type(module).__name__)


def _activation_names(model: nn.Module) -> str:
    names = {type(m).__name__ for b in model.blocks for m in b.modules() if not list(m.children())}
    acts = sorted(n for n in names if any(a in n.lower() for a in ("gelu", "silu", "relu", "act")))
    return ", ".join(acts) or "none found"


def apply_approx_grads(model: nn.Module, *, gelu_bits: int, randomized_linear: float) -> nn.Module:
    """Swap the blocks' GELUs and linear layers in place (parameter names unchanged); a model
    without them is refused (ConfigError), never silently left exact."""
    swapped_gelu = swapped_linear = 0
    for block in model.blocks:
        for parent in list(block.modules()):
            for name, child in list(parent.named_children()):
                form = gelu_form(child)
                if gelu_bits and form is not None:
                    setattr(parent, name, FewBitGELU(gelu_bits, form))
                    swapped_gelu += 1
                elif randomized_linear and type(child) is nn.Linear:
                    child.__class__ = RandomizedLinear
                    child.keep = randomized_linear
                    swapped_linear += 1
    if gelu_bits and not swapped_gelu:
        raise ConfigError(
            "memory.gelu_bits",
            f"the model's blocks have no GELU (activations: {_activation_names(model)}); "
            "few-bit backward is built for GELU: set it to 0",
        )
    if randomized_linear and not swapped_linear:
        kinds = sorted(
            {type(m).__name__ for b in model.blocks for m in b.modules() if hasattr(m, "weight")}
        )
        raise ConfigError(
            "memory.randomized_linear",
            f"the model's blocks have no nn.Linear layers (weighted layers: {', '.join(kinds)}); "
            "set it to 0",
        )
    return model
