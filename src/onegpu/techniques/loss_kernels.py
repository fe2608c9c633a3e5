"""The chunked loss's per-chunk math as inductor kernels (`train.loss_kernel`).

Eagerly, each chunk of the chunked loss (techniques/chunked_loss.py) passes over its
[chunk, vocab] block once per ATen kernel: the matmul's 16-bit logits copied to fp32, `amax`,
`softmax` (three passes of its own), `amax` of the probabilities, the cast of the gradient back
to 16 bits; then the output weight's gradient is made in 16 bits, copied to fp32 and added. On a
CPU those passes, not the three matmuls, are what the chunked loss adds to its floor: at
`seed-ref`'s 1,024 x 50,257 chunk in bf16, 45 ms of passes beside a 67 ms matmul.

Compiled, one inductor kernel reads the block in the matmul's dtype (three times: max, sum of
exponentials, gradient), fuses the log-sum-exp, the target's logit and the one-hot into those
passes and writes the gradient once, in the matmul's dtype; a second kernel adds the
weight gradient's 16-bit product into its fp32 sum in one pass. What Liger-Kernel's fused
linear cross-entropy does on GPUs with Triton, here written once in torch and left to inductor,
so it runs wherever inductor does (C++ on CPUs, Triton on GPUs). The loss is the same sum in
another order (fp32 rounding apart: `benchmarks/same_losses.py`).

`auto` (techniques/loss_kernel_auto.py) times both once per shape and device and compiles where
the saving over the run's micro-batches outweighs the compile time.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F


def softmax_grad(
    logits_cV: torch.Tensor,
    safe_t: torch.Tensor,
    valid_c1: torch.Tensor,
    n_valid: int,
    out_dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(summed loss, d loss / d logits = softmax - onehot in `out_dtype`) of a chunk, written
    for inductor: the logits read in their own dtype, the softmax over the first `n_valid`
    columns (the rest is vocabulary padding, probability 0: its gradient written as zeros),
    ignored tokens (`valid_c1` False) adding nothing. With padding, inductor keeps the valid
    columns' fp32 exponentials (one fp32 block where ATen's path keeps two) and computes each
    once: 25 ms a 1,024 x 50,304 chunk, against 32 ms masking the padding in every pass with
    no fp32 block, and 45 ms for ATen's kernels (benchmarks/results/loss-kernels-*.md)."""
    x_cV = logits_cV[:, :n_valid].float()
    max_c1 = x_cV.amax(dim=1, keepdim=True)
    exp_cV = (x_cV - max_c1).exp()
    sum_c1 = exp_cV.sum(dim=1, keepdim=True)
    valid_c1 = valid_c1.to(torch.float32)
    loss = ((max_c1 + sum_c1.log() - x_cV.gather(1, safe_t)) * valid_c1).sum()
    cols_V = torch.arange(n_valid, device=x_cV.device)
    g_cV = exp_cV / sum_c1 - (cols_V == safe_t).to(torch.float32) * valid_c1
    if n_valid < logits_cV.shape[1]:
        g_cV = F.pad(g_cV, (0, logits_cV.shape[1] - n_valid))
    return loss, g_cV.to(out_dtype)


def add_product(acc_VD: torch.Tensor, a_VC: torch.Tensor, b_CD: torch.Tensor) -> None:
    """acc += a @ b, the product made in the inputs' dtype and added into `acc`'s (fp32): one
    pass where eager makes the 16-bit product, an fp32 copy of it, then the sum."""
    acc_VD.add_((a_VC @ b_CD).to(acc_VD.dtype))


@dataclass(frozen=True, slots=True)
class LossKernels:
    """The compiled kernels, made once per process (dynamo's cache holds one graph per shape:
    a chunk and the last, shorter one; a block of vocabulary rows and the last)."""

    softmax_grad: Callable[..., tuple[torch.Tensor, torch.Tensor]]
    add_product: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], None]


_COMPILED: list[LossKernels] = []


def compiled_kernels() -> LossKernels:
    if not _COMPILED:
        _COMPILED.append(
            LossKernels(
                softmax_grad=torch.compile(softmax_grad, dynamic=False),
                add_product=torch.compile(add_product, dynamic=False),
            )
        )
    return _COMPILED[0]


def kernels_for(name: str) -> LossKernels | None:
    """`train.loss_kernel` as resolved: the compiled kernels, or None (ATen's, eagerly)."""
    return compiled_kernels() if name == "compiled" else None
