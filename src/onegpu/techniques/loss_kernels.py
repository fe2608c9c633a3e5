"""The chunked loss's per-chunk math as compiled kernels (`train.loss_kernel`).

Eagerly, each chunk of the chunked loss (techniques/chunked_loss.py) passes over its
[chunk, vocab] block once per ATen kernel: the matmul's 16-bit logits copied to fp32, `amax`,
`softmax` (three passes of its own), `amax` of the probabilities, the cast of the gradient back
to 16 bits; then the output weight's gradient is made in 16 bits, copied to fp32 and added. On a
CPU those passes, not the three matmuls, are what the chunked loss adds to its floor: at
`seed-ref`'s 1,024 x 50,257 chunk in bf16, 45 ms of passes beside a 67 ms matmul.

Compiled, one kernel reads the block in the matmul's dtype, fuses the log-sum-exp, the target's
logit and the one-hot into its passes and writes the gradient once, in the matmul's dtype; a
second kernel adds the weight gradient's 16-bit product into its fp32 sum in one pass. On a GPU
the first is inductor's (Triton) from `softmax_grad` below, what Liger-Kernel's fused linear
cross-entropy does with Triton; on a CPU it is onegpu's C++ kernel (loss_kernel_cpu.py), which
computes each exponential once a row where inductor's computes it twice or sends a fp32 block
to memory and back. The loss is the same sum in another order (fp32 rounding apart:
`benchmarks/same_losses.py`).

`auto` (techniques/loss_kernel_auto.py) times both once per shape and device and compiles where
the saving over the run's micro-batches outweighs the compile time.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from onegpu.techniques import loss_kernel_cpu


def softmax_grad(
    logits_cV: torch.Tensor,
    safe_t: torch.Tensor,
    valid_c1: torch.Tensor,
    n_valid: int,
    out_dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(summed loss, d loss / d logits = softmax - onehot in `out_dtype`) of a chunk, written
    for inductor: the logits read in their own dtype, columns from `n_valid` on (vocabulary
    padding) at probability 0, ignored tokens (`valid_c1` False) adding nothing.

    Padding, 16-bit logits: the softmax over the valid columns, the padding's gradient written
    as zeros; inductor then keeps the valid columns' fp32 exponentials (one fp32 block, where
    ATen's path keeps two) and computes each once, which beats masking the padding in every
    pass (benchmarks/loss_kernels.py --softmax). fp32 logits are a block of that size already:
    there the padding is masked in every pass, so no second fp32 block is added to them."""
    width = logits_cV.shape[1]
    if _keeps_valid_exponentials(logits_cV, n_valid):
        loss, g_cV = _valid_softmax_grad(logits_cV[:, :n_valid], safe_t, valid_c1)
        return loss, F.pad(g_cV, (0, width - n_valid)).to(out_dtype)
    if n_valid < width:
        cols_V = torch.arange(width, device=logits_cV.device)
        logits_cV = logits_cV.masked_fill(cols_V >= n_valid, float("-inf"))
    loss, g_cV = _valid_softmax_grad(logits_cV, safe_t, valid_c1)
    return loss, g_cV.to(out_dtype)


def _keeps_valid_exponentials(logits_cV: torch.Tensor, n_valid: int) -> bool:
    """16-bit logits with vocabulary padding: the kernel keeps the valid columns' fp32
    exponentials (one fp32 block), which its footprint for a plan must hold too."""
    return n_valid < logits_cV.shape[1] and logits_cV.element_size() < 4


def _valid_softmax_grad(
    logits_cV: torch.Tensor, safe_t: torch.Tensor, valid_c1: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The fp32 math over every column given: max, sum of exponentials, log-sum-exp, the
    target's logit and softmax - onehot, left to inductor to fuse."""
    x_cV = logits_cV.float()
    max_c1 = x_cV.amax(dim=1, keepdim=True)
    exp_cV = (x_cV - max_c1).exp()
    sum_c1 = exp_cV.sum(dim=1, keepdim=True)
    valid_c1 = valid_c1.to(torch.float32)
    loss = ((max_c1 + sum_c1.log() - x_cV.gather(1, safe_t)) * valid_c1).sum()
    cols_V = torch.arange(x_cV.shape[1], device=x_cV.device)
    return loss, exp_cV / sum_c1 - (cols_V == safe_t).to(torch.float32) * valid_c1


def add_product(acc_VD: torch.Tensor, a_VC: torch.Tensor, b_CD: torch.Tensor) -> None:
    """acc += a @ b, the product made in the inputs' dtype and added in the promoted one (a
    16-bit product into fp32 gradients): one pass where eager makes the 16-bit product, an fp32
    copy of it, then the sum."""
    acc_VD.add_(a_VC @ b_CD)


@dataclass(frozen=True, slots=True)
class LossKernels:
    """The compiled kernels, made once per process (dynamo's cache holds one graph per shape:
    a chunk and the last, shorter one; a block of vocabulary rows and the last)."""

    softmax_grad: Callable[..., tuple[torch.Tensor, torch.Tensor]]
    add_product: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], None]


_COMPILED: list[LossKernels] = []
_INDUCTOR: list[Callable[..., tuple[torch.Tensor, torch.Tensor]]] = []


def _inductors_softmax_grad() -> Callable[..., tuple[torch.Tensor, torch.Tensor]]:
    """`softmax_grad` compiled (lazily: on its first call), a whole graph or an error."""
    if not _INDUCTOR:
        _INDUCTOR.append(torch.compile(softmax_grad, dynamic=False, fullgraph=True))
    return _INDUCTOR[0]


def compiled_kernels() -> LossKernels:
    """The kernels compiled (lazily: on their first call), whole graphs or an error: a graph
    break would run part of them eagerly without a word. The softmax gradient of a chunk on a
    CPU is the C++ kernel's (`cpu_softmax_grad`; inside a compiled graph, its op), inductor's
    elsewhere."""
    if not _COMPILED:
        _COMPILED.append(
            LossKernels(
                softmax_grad=_compiled_softmax_grad,
                add_product=torch.compile(add_product, dynamic=False, fullgraph=True),
            )
        )
    return _COMPILED[0]


def _compiled_softmax_grad(
    logits_cV: torch.Tensor,
    safe_t: torch.Tensor,
    valid_c1: torch.Tensor,
    n_valid: int,
    out_dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor]:
    if not loss_kernel_cpu.suits(logits_cV, out_dtype):
        return _inductors_softmax_grad()(logits_cV, safe_t, valid_c1, n_valid, out_dtype)
    kernel = chunk_softmax_grad_op if torch.compiler.is_compiling() else cpu_softmax_grad
    return kernel(logits_cV, safe_t, valid_c1, n_valid, out_dtype)


def cpu_softmax_grad(
    logits_cV: torch.Tensor,
    safe_t: torch.Tensor,
    valid_c1: torch.Tensor,
    n_valid: int,
    out_dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor]:
    """A CPU chunk's `softmax_grad`: the C++ kernel where it built (loss_kernel_cpu.applies),
    else inductor's."""
    if loss_kernel_cpu.applies(logits_cV, out_dtype):
        return loss_kernel_cpu.softmax_grad(logits_cV, safe_t, valid_c1, n_valid, out_dtype)
    return _inductors_softmax_grad()(logits_cV, safe_t, valid_c1, n_valid, out_dtype)


chunk_softmax_grad_op = torch.library.custom_op(
    "onegpu::chunk_softmax_grad", cpu_softmax_grad, mutates_args=(), device_types="cpu"
)
"""`cpu_softmax_grad` as an op of its own, for a graph compiled around the loss
(`train.compile default` or `max-autotune`) to call as it is: dynamo cannot trace the C++
extension's call, and broke the graph around it (a warning on stderr at each compile). Eager
calls skip the dispatcher and call the function."""


def footprint_softmax_grad(
    logits_cV: torch.Tensor,
    safe_t: torch.Tensor,
    valid_c1: torch.Tensor,
    n_valid: int,
    out_dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor]:
    """What the compiled `softmax_grad` allocates, for a plan's fake tensors (which no inductor
    kernel runs on): the buffers of its graph, in its order. Two [chunk, 1] fp32 vectors (max,
    sum of exponentials; the C++ kernel's per-row losses); the valid columns' fp32 exponentials
    only where inductor's kernel takes 16-bit logits with vocabulary padding (it recomputes them
    in the gradient's pass otherwise; the C++ kernel keeps one row's); the loss; the gradient in
    `out_dtype`. ATen's path, which a plan would follow otherwise, keeps two fp32 blocks: a plan
    of a compiled loss kernel was 59% over its measured bf16 step."""
    c, width = logits_cV.shape
    vectors = [logits_cV.new_empty((c, 1), dtype=torch.float32) for _ in range(2)]
    exps = None
    inductors = not loss_kernel_cpu.suits(logits_cV, out_dtype)
    if inductors and _keeps_valid_exponentials(logits_cV, n_valid):
        exps = logits_cV.new_empty((c, n_valid), dtype=torch.float32)
    loss = logits_cV.new_zeros((), dtype=torch.float32)
    g_cV = logits_cV.new_empty((c, width), dtype=out_dtype)
    del vectors, exps
    return loss, g_cV


chunk_softmax_grad_op.register_fake(footprint_softmax_grad)

FOOTPRINTS = LossKernels(softmax_grad=footprint_softmax_grad, add_product=add_product)
"""The compiled kernels' allocations, for a plan: `add_product`'s graph keeps the 16-bit
product, as ATen's `add_` of it does on fake tensors."""


def kernels_for(name: str, *, planning: bool = False) -> LossKernels | None:
    """`train.loss_kernel` as resolved: the compiled kernels (their footprints in a plan), or
    None (ATen's, eagerly)."""
    if name != "compiled":
        return None
    return FOOTPRINTS if planning else compiled_kernels()
