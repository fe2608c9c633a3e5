"""What a planned step's bytes are: the kind of each saved tensor and the block it belongs to
(the plan's "saved activations by kind / by block" lines)."""

from __future__ import annotations

import torch
from torch import nn


def saved_kind(op: str, module: str, dtype: torch.dtype) -> str:
    """What a saved tensor is, from the op that made it and the module it was made in."""
    if dtype in (torch.bool, torch.uint8) or "dropout" in op or "bernoulli" in op:
        return "dropout masks / bit codes"
    if "attention" in op:
        return "attention (outputs, logsumexp)"
    if "layer_norm" in op:
        return "norms (outputs, mean, rstd)"
    if "gelu" in op:
        return "GELU"
    if module.endswith("lm_head") or "cross_entropy" in op or "log_softmax" in op:
        return "logits / loss"
    if op in ("aten.mm", "aten.addmm", "aten.bmm", "aten.baddbmm"):
        return "matmul outputs"
    if module.endswith("attn") and op in ("aten._softmax", "aten._to_copy"):
        return "attention scores / probabilities"
    if op == "aten._to_copy":
        return "16-bit copies (autocast)"
    if op in ("aten.add", "aten.add_"):
        return "residual stream"
    if op in ("aten.clone", "aten._unsafe_view", "aten.view", "aten.cat", "aten.transpose"):
        return "reshaped copies"
    if "embedding" in op or module in ("wte", "wpe", "drop"):
        return "embeddings"
    return "other"


def block_prefixes(model: nn.Module) -> dict[str, str]:
    """Module name of each block -> 'blocks.N' (a transformers model's blocks live deeper,
    e.g. hf.model.layers.N)."""
    names = {id(m): n for n, m in model.named_modules()}
    return {names[id(b)]: f"blocks.{i}" for i, b in enumerate(model.blocks) if id(b) in names}


def block_of(module: str, prefixes: dict[str, str]) -> str:
    for prefix, block in prefixes.items():
        if module == prefix or module.startswith(prefix + "."):
            return block
    head = module.split(".")[0]
    return "loss" if not head else "embeddings/head" if head == "hf" else head
