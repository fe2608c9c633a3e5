"""Activation checkpointing at any granularity, with selective policies.

`memory.checkpointing`:
  none        keep every activation
  attn, mlp   recompute that residual branch of each block in backward (its LayerNorm included)
  attn+mlp    both branches (seed 000's remat of MLP and Attn): keeps only the residual stream
  block       recompute whole blocks: keeps one [B, T, D] input per block
  every:K     whole-block checkpointing of every K-th block (0, K, 2K, ...): a memory/time dial
  selective   whole blocks, but matmul and attention outputs are saved and only the cheap
              element-wise ops (norms, GELU, dropout, casts) are recomputed: the analogue of
              JAX's `dots_saveable` (seed 002), via PyTorch's selective checkpoint contexts

All use PyTorch's non-reentrant checkpoint with the RNG state preserved, so recomputed dropout
masks equal the original ones and gradients are unchanged (seed 003 warns that hand-rolled
checkpointing around dropout silently trains a different model).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
from torch import nn
from torch.utils.checkpoint import (
    CheckpointPolicy,
    checkpoint,
    create_selective_checkpoint_contexts,
)

from onegpu.config import ConfigError
from onegpu.memory.saved import ACTIVE_COUNTERS

MODES = ("none", "attn", "mlp", "attn+mlp", "block", "every:K", "selective")

_aten = torch.ops.aten
# Outputs worth keeping: the FLOP-heavy ops. Everything else is recomputed.
_SAVE_OPS = {
    _aten.mm.default,
    _aten.addmm.default,
    _aten.bmm.default,
    _aten.baddbmm.default,
}
for _name in (
    "_scaled_dot_product_flash_attention",
    "_scaled_dot_product_flash_attention_for_cpu",
    "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_cudnn_attention",
):
    if hasattr(_aten, _name):
        _SAVE_OPS.add(getattr(_aten, _name).default)


def parse_mode(mode: str) -> tuple[str, int]:
    """('every', K) for 'every:K', else (mode, 1); ConfigError for anything else."""
    if mode.startswith("every:"):
        try:
            k = int(mode.split(":", 1)[1])
        except ValueError:
            k = 0
        if k < 1:
            raise ConfigError(
                "memory.checkpointing", f"{mode!r}: K must be a positive integer, e.g. every:2"
            )
        return "every", k
    if mode not in MODES:
        raise ConfigError("memory.checkpointing", f"{mode!r} is not one of {', '.join(MODES)}")
    return mode, 1


def _save_matmuls_policy(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op in _SAVE_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def _selective_context():
    forward_ctx, recompute_ctx = create_selective_checkpoint_contexts(_save_matmuls_policy)
    for counter in ACTIVE_COUNTERS:  # its saved outputs bypass saved_tensors_hooks
        counter.track_cache(getattr(forward_ctx, "storage", None))
    return forward_ctx, recompute_ctx


def checkpoint_module(module: nn.Module, *, context_fn: Callable | None = None) -> nn.Module:
    """Make `module` recompute its forward in backward. Parameter names are unchanged (the
    forward is replaced on the instance, no wrapper module), so state dicts stay portable."""
    inner = module.forward
    kwargs = {"context_fn": context_fn} if context_fn is not None else {}

    @functools.wraps(inner)
    def forward(*args):
        return checkpoint(inner, *args, use_reentrant=False, preserve_rng_state=True, **kwargs)

    module.forward = forward
    module._onegpu_checkpointed = True
    return module


def apply_checkpointing(model: nn.Module, mode: str) -> nn.Module:
    kind, k = parse_mode(mode)
    if kind == "none":
        return model
    for i, block in enumerate(model.blocks):
        if kind in ("attn", "attn+mlp"):
            checkpoint_module(block.attn)
        if kind in ("mlp", "attn+mlp"):
            checkpoint_module(block.mlp)
        if kind == "block" or (kind == "every" and i % k == 0):
            checkpoint_module(block)
        if kind == "selective":
            checkpoint_module(block, context_fn=_selective_context)
    return model
