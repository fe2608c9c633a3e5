"""The chunked loss's per-chunk softmax gradient on a CPU: a C++ kernel of onegpu's own
(`csrc/chunk_softmax_grad.cpp`), built on first use with the compiler inductor uses.

Why not inductor's: its kernel for this math (techniques/loss_kernels.py) computes each
exponential twice, once for the sum and once for the gradient, or, where the vocabulary is
padded, keeps the exponentials in a [chunk, vocab] fp32 block that goes out to memory and back.
On 2 AMX cores that block made A's per-chunk kernel (1,024 x 50,257, bf16) memory-bound: 55
ms. This kernel works a row at a time, keeps the row's exponentials in a buffer that stays in
the core's cache and computes each once: 26 ms there, and 9 against 16 ms at B's 2,048 x
8,192, where its gradient equals inductor's bit for bit (`benchmarks/loss_kernels.py
--softmax`; A's step 1.21x, B's 1.04x faster, docs/floor.md). The exponential is ATen's
vectorised one (Sleef), as in inductor's kernel.

Built for the CPU's vector width (torch's own dispatch level: AVX512, AVX2 or none), cached by
torch under ~/.cache/torch_extensions; the same compiler inductor needs, so `compiled` is
available exactly where it was before.
"""

from __future__ import annotations

import functools
from types import ModuleType

import torch

from onegpu.techniques import cpu_extension

DTYPES = (torch.bfloat16, torch.float32)


def applies(logits_cV: torch.Tensor, out_dtype: torch.dtype) -> bool:
    """Whether the C++ kernel computes this chunk: it suits it, and it built here."""
    return suits(logits_cV, out_dtype) and built()


def suits(logits_cV: torch.Tensor, out_dtype: torch.dtype) -> bool:
    """Whether the chunk is one the kernel computes: CPU logits in bf16 or fp32, the gradient in
    their own dtype (as every CPU precision asks). What a plan follows: it builds nothing."""
    return (
        logits_cV.device.type == "cpu"
        and logits_cV.dtype in DTYPES
        and out_dtype == logits_cV.dtype
    )


@functools.cache
def built() -> bool:
    """Whether the kernel builds here; where it does not, inductor's kernel computes the chunks
    (and a warning says why, once)."""
    return cpu_extension.builds(
        extension, "loss kernel", "inductor's kernel computes the chunked loss instead"
    )


def extension() -> ModuleType:
    """The kernel, built once per torch version and CPU dispatch level (cpu_extension.py)."""
    return cpu_extension.load("chunk_softmax_grad")


def softmax_grad(
    logits_cV: torch.Tensor,
    safe_t: torch.Tensor,
    valid_c1: torch.Tensor,
    n_valid: int,
    out_dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(summed loss, d loss / d logits = softmax - onehot) of a chunk, as
    loss_kernels.softmax_grad computes it (where `applies`: the gradient in the logits' dtype)."""
    loss, grad = extension().softmax_grad(
        logits_cV.contiguous(), safe_t.flatten(), valid_c1.flatten(), n_valid
    )
    return loss, grad
