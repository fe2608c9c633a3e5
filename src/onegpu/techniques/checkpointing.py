"""Activation checkpointing at any granularity, with selective policies.

`memory.checkpointing` (parsed into `config.Checkpointing`):
  none        keep every activation
  attn, mlp   recompute that residual branch of each block in backward (in our GPT its
              LayerNorm included; in transformers' decoder layers the norm sits outside)
  attn+mlp    both branches (the "remat of MLP and attention" of Lippe's UvA tutorial "Profiling
              and Scaling Single-GPU Transformer Models"): keeps only the residual stream
  block       recompute whole blocks: keeps one [B, T, D] input per block
  every:K     whole-block checkpointing of every K-th block (0, K, 2K, ...): a memory/time dial
  budget-compiled:F  nothing wrapped: torch.compile's min-cut partitioner keeps at most a
              fraction F of what it would save (`activation_memory_budget`), recomputing the
              rest by its own cost model
  selective   whole blocks, but matmul and attention outputs are saved and only the cheap
              element-wise ops (norms, GELU, dropout, casts) are recomputed: the analogue of
              JAX's `dots_saveable` policy, via PyTorch's selective checkpoint contexts
              (with `blocked` attention that keeps its fp32 scores: `auto` picks it only
              without selective checkpointing)
  dots        the same on this backend: the attention kernel's output is one fused op here,
              kept by `selective` already. On the JAX backend the two differ: selective is
              `dots_with_no_batch_dims_saveable` (attention's batched matmuls recomputed), dots
              is `dots_saveable`

All use PyTorch's non-reentrant checkpoint with the RNG state preserved, so recomputed dropout
masks equal the original ones and gradients are unchanged (hand-rolled checkpointing around
dropout silently trains a different model: "Optimising the Training Loop", Super-Fast-LLM-Training).
"""

from __future__ import annotations

import functools
import inspect
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch._functorch.config as functorch_config
from torch import nn
from torch.utils.checkpoint import (
    CheckpointPolicy,
    checkpoint,
    create_selective_checkpoint_contexts,
)

from onegpu.config import Checkpointing, ConfigError

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


def _save_matmuls_policy(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op in _SAVE_OPS else CheckpointPolicy.PREFER_RECOMPUTE


class SelectiveContexts:
    """The `context_fn` of one selectively checkpointed module. The outputs it keeps bypass
    `saved_tensors_hooks` (they sit in the recompute context's cache until backward), so it
    holds weak references to the live caches for memory accounting (`cached_tensors`)."""

    def __init__(self) -> None:
        self._live: weakref.WeakSet = weakref.WeakSet()

    def __call__(self):
        forward_ctx, recompute_ctx = create_selective_checkpoint_contexts(_save_matmuls_policy)
        self._live.add(recompute_ctx)  # alive as long as the autograd graph that needs it
        return forward_ctx, recompute_ctx

    def cached_tensors(self) -> Iterator[torch.Tensor]:
        for ctx in list(self._live):
            for leaf in torch.utils._pytree.tree_leaves(dict(getattr(ctx, "storage", {}))):
                t = getattr(leaf, "val", leaf)  # torch wraps cached outputs in _VersionWrapper
                if isinstance(t, torch.Tensor):
                    yield t


_HOOKS_CHOICE = "respect_saved_tensors_hooks" in inspect.signature(checkpoint).parameters
"""Newer torch (2.14 warns, 2.13 has no such argument) asks whether selective checkpointing's
saved outputs go through saved-tensor hooks (activation offload): they always bypassed them,
which SelectiveContexts accounts for."""


def checkpoint_module(module: nn.Module, *, context_fn: Callable | None = None) -> nn.Module:
    """Make `module` recompute its forward in backward. Parameter names are unchanged (the
    forward is replaced on the instance, no wrapper module), so state dicts stay portable."""
    inner = module.forward
    kwargs: dict[str, Any] = {}
    if context_fn is not None:
        kwargs["context_fn"] = context_fn
        if _HOOKS_CHOICE:  # what selective saves bypasses save_on_cpu, as the planner counts
            kwargs["respect_saved_tensors_hooks"] = False

    @functools.wraps(inner)
    def forward(*args, **call_kwargs):
        return checkpoint(
            inner, *args, use_reentrant=False, preserve_rng_state=True, **kwargs, **call_kwargs
        )

    module.forward = forward
    return module


BRANCH_NAMES = {
    "attn": ("attn", "self_attn", "attention", "self_attention"),
    "mlp": ("mlp", "feed_forward", "ffn"),
}
"""What blocks call their two residual branches: ours, and transformers' decoder layers."""


def block_branch(block: nn.Module, kind: str) -> nn.Module:
    """A block's attention ('attn') or MLP ('mlp') sub-module, or ConfigError."""
    for name in BRANCH_NAMES[kind]:
        branch = getattr(block, name, None)
        if isinstance(branch, nn.Module):
            return branch
    children = ", ".join(n for n, _ in block.named_children())
    raise ConfigError(
        "memory.checkpointing",
        f"{type(block).__name__} has no {kind} sub-module (it has: {children}); "
        "use block, every:K or selective",
    )


def apply_checkpointing(model: nn.Module, mode: Checkpointing) -> nn.Module:
    """Wrap the sub-modules `mode` names in every block (after any layer swaps inside them);
    for budget-compiled, set what torch.compile's partitioner may keep (process-wide, read when
    a graph compiles; every build sets it, so one build's setting never outlives it)."""
    functorch_config.activation_memory_budget = (
        mode.fraction if mode.kind == "budget-compiled" else 1.0
    )
    if mode.kind in ("none", "budget-compiled"):
        return model
    if mode.kind == "budget":  # planned into blocks:... before a build (plan/budget.py)
        raise ConfigError(
            "memory.checkpointing",
            "budget:BYTES is decided by `onegpu train` and `onegpu plan`; here give a per-block "
            "plan (blocks:...: `onegpu plan --best-toml` writes it) or a uniform policy",
        )
    n_blocks = len(model.blocks)
    if mode.kind == "blocks" and len(mode.per_block) != n_blocks:
        raise ConfigError(
            "memory.checkpointing",
            f"the per-block plan names {len(mode.per_block)} blocks, the model has {n_blocks}",
        )
    for name, block in model.blocks.named_children():  # a pipeline stage's keep their indices
        policy = mode.policy_of(int(name))
        if policy in ("attn", "attn+mlp"):
            checkpoint_module(block_branch(block, "attn"))
        if policy in ("mlp", "attn+mlp"):
            checkpoint_module(block_branch(block, "mlp"))
        if policy == "block":
            checkpoint_module(block)
        if policy in ("selective", "dots"):
            block._selective_contexts = SelectiveContexts()
            checkpoint_module(block, context_fn=block._selective_contexts)
    return model


def selective_cache_tensors(model: nn.Module) -> Iterator[torch.Tensor]:
    """Tensors held by selective checkpointing's caches now (empty for other modes)."""
    for module in model.modules():
        contexts = getattr(module, "_selective_contexts", None)
        if contexts is not None:
            yield from contexts.cached_tensors()
