"""`model.attention blocked`: causal attention as batched matmuls over query blocks.

Why: torch's CPU flash kernel runs its products in small tiles with the softmax between
them, and its backward recomputes the probabilities tile by tile. On 2 Zen 4 cores (bf16,
16 x 6 heads x 256 x 64, mimalloc) its forward + backward took ~41 ms a layer while the same
products as whole batched matmuls run at the machine's bf16 peak (~2 ms each). This kernel:

- splits the queries into up to `MAX_BLOCKS` row blocks; block i attends to keys [0, end_i) only,
  so the masked upper blocks are never computed (5/8 of the full products at 4 blocks);
- computes each block's scores with one batched matmul in fp32 (of the 16-bit values, so
  exact products and fp32 sums, as flash keeps them) and the scaled, masked softmax in fp32;
- saves the 16-bit probabilities for backward instead of recomputing them, which costs
  `saved_prob_bytes` of memory a layer (about T^2/2 per head) and saves a product and a softmax.

Measured alone (`benchmarks/attention_kernels.py`), forward + backward a layer: ~27 ms vs
flash's ~43 ms at 16 x 6 x 256 x 64, ~26 vs ~53 ms at 8 x 4 x 512 x 64 (with 16-bit scores
it was ~24 and ~25 ms, at several times flash's error for wider logits). `auto` times it
against SDPA for the run's shape and picks it only where it wins and its probabilities are
small beside the block's other activations. No dropout (the probabilities are saved undropped).

Shape suffixes as in gpt.py; S keys of a block (end_i), R query rows of a block.
"""

from __future__ import annotations

import math

import torch

from onegpu.perf.attention_blocks import query_blocks


def _probabilities(
    q_BHRK: torch.Tensor,
    k_BHSK: torch.Tensor,
    start: int,
    mask_B1RS: torch.Tensor | None,
) -> torch.Tensor:
    """softmax(q k^T / sqrt(K) + mask) in fp32, returned in q's dtype for the next product.

    The scores are an fp32 product of the 16-bit values (exact products, fp32 sums), as flash
    keeps them: rounded to bf16, at 4-8x wider logits than unit-variance ones the output's
    error grew to 5-8x flash's. Autocast is off around it, or it would cast them back."""
    with torch.autocast(q_BHRK.device.type, enabled=False):
        scores_BHRS = torch.matmul(q_BHRK.float(), k_BHSK.float().transpose(-1, -2))
    scale = 1.0 / math.sqrt(q_BHRK.shape[-1])
    if mask_B1RS is None:  # causal: query start + r sees keys s <= start + r
        return causal_softmax(scores_BHRS, start, scale, q_BHRK.dtype)
    logits_BHRS = scores_BHRS.mul_(scale).masked_fill_(~mask_B1RS, float("-inf"))
    return logits_BHRS.softmax(dim=-1).to(q_BHRK.dtype)


def aten_causal_softmax(
    scores_BHRS: torch.Tensor, start: int, scale: float, out_dtype: torch.dtype
) -> torch.Tensor:
    """softmax(scores * scale), query start + r seeing keys s <= start + r, in `out_dtype`:
    ATen's kernels, also under compile (an op of its own, which inductor calls as it is; on a
    CPU onegpu's one-pass kernel replaces them, techniques/causal_softmax_cpu.py).

    Inductor fuses the scale, the mask, the softmax and the cast into one kernel that
    computes each exponential twice (for the sum, then for the output); ATen's softmax
    computes it once and keeps it. On a 2-core AMX Xeon, with _per_block's copies, a compiled
    layer's forward + backward took 0.85x the time at B's shape and 0.91x at A's; about 2% of
    B's step (docs/floor.md)."""
    R, S = scores_BHRS.shape[-2:]
    causal_RS = torch.full((R, S), float("-inf"), device=scores_BHRS.device).triu_(start + 1)
    logits_BHRS = torch.add(causal_RS, scores_BHRS, alpha=scale)
    return logits_BHRS.softmax(dim=-1).to(out_dtype)


causal_softmax = torch.library.custom_op(
    "onegpu::causal_softmax", aten_causal_softmax, mutates_args=()
)
# a plan's fake tensors run the same ops: its peak sees the op's fp32 temporaries
causal_softmax.register_fake(aten_causal_softmax)


def _heads_view(make, like_BHTK: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A [B, H, T, K] view of a new [B, T, H, K] tensor: the layout the projections read and
    write, so that the transposes around attention stay views."""
    B, H, T, K = like_BHTK.shape
    return make(B, T, H, K, dtype=dtype, device=like_BHTK.device).transpose(1, 2)


def _per_block(x_BHTK: torch.Tensor, blocks: list[tuple[int, int]]) -> list[torch.Tensor]:
    """Each query block's rows of `x` as a tensor of its own, heads-major ([B, H, R, K]
    contiguous). A block's slice of one heads-major tensor is not a compact batch of matrices,
    and the CPU's batched matmul copied it every time it read it (three times a block in
    forward and backward, `onegpu profile`: `aten::bmm > aten::contiguous`): here each
    block's rows are copied once, in the copy that makes them heads-major anyway."""
    return [x_BHTK[..., start:end, :].contiguous() for start, end in blocks]


class BlockedAttention(torch.autograd.Function):
    """Forward saves k, v, each block's queries and probabilities; backward is four products a
    block."""

    @staticmethod
    def forward(ctx, q_BHTK, k_BHTK, v_BHTK, mask_B1TT):  # type: ignore[override]
        # keys and values heads-major once: every block reads a prefix of them as a view
        k_BHTK, v_BHTK = k_BHTK.contiguous(), v_BHTK.contiguous()
        blocks = query_blocks(q_BHTK.shape[-2])
        qs = _per_block(q_BHTK, blocks)
        y_BHTK = _heads_view(torch.empty, q_BHTK, q_BHTK.dtype)
        probs = []
        for (start, end), q_BHRK in zip(blocks, qs, strict=True):
            mask = None if mask_B1TT is None else mask_B1TT[..., start:end, :end]
            p_BHRS = _probabilities(q_BHRK, k_BHTK[..., :end, :], start, mask)
            y_BHTK[..., start:end, :] = torch.matmul(p_BHRS, v_BHTK[..., :end, :])
            probs.append(p_BHRS)
        ctx.save_for_backward(k_BHTK, v_BHTK, *qs, *probs)
        return y_BHTK

    @staticmethod
    def backward(ctx, dy_BHTK):  # type: ignore[override]
        k_BHTK, v_BHTK, *saved = ctx.saved_tensors
        T, K = k_BHTK.shape[-2:]
        blocks = query_blocks(T)
        qs, probs = saved[: len(blocks)], saved[len(blocks) :]
        scale = 1.0 / math.sqrt(K)
        dq_BHTK = _heads_view(torch.empty, k_BHTK, k_BHTK.dtype)
        # keys are shared by all later blocks: their gradients sum over blocks in fp32
        dk_BHTK = _heads_view(torch.zeros, k_BHTK, torch.float32)
        dv_BHTK = _heads_view(torch.zeros, v_BHTK, torch.float32)
        dys = _per_block(dy_BHTK, blocks)
        for (start, end), q_BHRK, dy_BHRK, p_BHRS in zip(blocks, qs, dys, probs, strict=True):
            dv_BHTK[..., :end, :] += torch.matmul(p_BHRS.transpose(-1, -2), dy_BHRK)
            dp_BHRS = torch.matmul(dy_BHRK, v_BHTK[..., :end, :].transpose(-1, -2))
            ds_BHRS = torch.ops.aten._softmax_backward_data(dp_BHRS, p_BHRS, -1, p_BHRS.dtype)
            dq_BHTK[..., start:end, :] = torch.matmul(ds_BHRS, k_BHTK[..., :end, :]).mul_(scale)
            dk_BHTK[..., :end, :] += torch.matmul(ds_BHRS.transpose(-1, -2), q_BHRK)
        dk_BHTK = dk_BHTK.mul_(scale).to(k_BHTK.dtype)
        return dq_BHTK, dk_BHTK, dv_BHTK.to(v_BHTK.dtype), None


def blocked_attention(
    q_BHTK: torch.Tensor,
    k_BHTK: torch.Tensor,
    v_BHTK: torch.Tensor,
    mask_B1TT: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention, or within `mask_B1TT` (True where a query may attend; it must lie
    within the causal mask, as packed documents' does: block i never reads keys past its end).
    The output is laid out [B, T, H, K] under its [B, H, T, K] view."""
    return BlockedAttention.apply(q_BHTK, k_BHTK, v_BHTK, mask_B1TT)
