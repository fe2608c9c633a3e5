"""Model FLOPs per token, counted from the built model.

Training costs 6 FLOPs per matmul weight per token (2 forward, 4 backward), plus attention's
score and value matmuls, 12 * n_layer * seq_len * d_model per token (PaLM's convention: the full
T x T product, although a causal kernel can skip half). Embedding lookups, norms and element-wise
ops are not counted: MFU measures useful matmul work only.
"""

from __future__ import annotations

from torch import nn

from onegpu.config import parse_checkpointing


def matmul_params(model: nn.Module) -> int:
    """Weights that take part in a matmul (a tied output layer counts: it is a matmul);
    transformers' GPT-2 keeps its linear layers as `Conv1D` modules."""
    return sum(
        m.weight.numel()
        for m in model.modules()
        if isinstance(m, nn.Linear) or type(m).__name__ == "Conv1D"
    )


def attention_flops_per_token(n_layer: int, seq_len: int, d_model: int) -> int:
    return 12 * n_layer * seq_len * d_model


def flops_per_token(model: nn.Module, seq_len: int) -> int:
    """Training FLOPs per token (forward + backward); the output layer's vocabulary padding is
    work, not model FLOPs, and is left out (MFU counts useful work)."""
    cfg = model.cfg
    padding = (model.padded_vocab - model.vocab_size) * cfg.d_model
    useful = matmul_params(model) - padding
    return 6 * useful + attention_flops_per_token(cfg.n_layer, seq_len, cfg.d_model)


RECOMPUTE = {
    "none": 1.0,
    "selective": 1.05,
    "dots": 1.05,
    "mlp": 1.15,
    "attn": 1.2,
    "attn+mlp": 1.3,
    "block": 1.33,
}
"""Compute of a step under each checkpointing policy, as a multiple of a plain step: forward is
about a third of a training step, so recomputing all of it in backward adds about a third
(Chen et al., "Training Deep Nets with Sublinear Memory Cost"); the partial policies recompute a
part of it (selective: only cheap element-wise ops, no matmuls)."""


def recompute_factor(checkpointing: str) -> float:
    """RECOMPUTE for a `memory.checkpointing` value (`every:K`: one block in K recomputed; a
    budget not yet decided: 1.0, the least it can be, for bounds and ordering)."""
    if checkpointing.startswith("every:"):
        return 1.0 + (RECOMPUTE["block"] - 1.0) / int(checkpointing.split(":")[1])
    if checkpointing.startswith("budget-compiled:"):  # up to block's, as less is kept
        kept = parse_checkpointing(checkpointing).fraction
        return 1.0 + (RECOMPUTE["block"] - 1.0) * (1.0 - kept)
    if checkpointing.startswith("budget:"):  # undecided: at least nothing is recomputed
        return 1.0
    if checkpointing.startswith("blocks:"):  # each block's share of its policy's recompute
        policies = parse_checkpointing(checkpointing).per_block
        return 1.0 + sum(RECOMPUTE[p] - 1.0 for p in policies) / len(policies)
    return RECOMPUTE[checkpointing]
