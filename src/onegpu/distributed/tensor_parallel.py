"""Megatron-style tensor parallelism with sequence parallelism, as torchtitan applies it, on
PyTorch's `torch.distributed.tensor.parallel`.

Within a block, each residual branch gathers the sequence once after its LayerNorm, splits its
first projections column-wise (each process computes its own heads / its slice of the MLP's
hidden units, no communication), and its output projection row-wise, whose partial sums are
reduce-scattered back onto the sequence. Between the branches (norms, dropout, the residual
adds) every process holds 1/tp of the tokens: sequence parallelism, so activations there are
divided by tp too. Per block and micro-batch that is two all-gathers and two reduce-scatters of
one [batch, seq, d_model] activation in forward, the same in backward.

The embedding is split by vocabulary rows (each process looks up the ids it holds, the partial
sums reduce-scattered onto the sequence); the output layer by vocabulary columns, and under
`loss_parallel` the cross-entropy runs on those vocabulary-sharded logits: no process ever holds
the full [tokens, vocab] logits. Every parameter becomes a DTensor on the tp mesh (the norms'
replicated), so clipping, the optimizer and Distributed Checkpoint treat all alike, and FSDP2 on
another mesh dimension shards them further (2-D).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch
from torch import nn

from onegpu.models.protocol import LossFn


def apply_tensor_parallel(model: nn.Module, tp_mesh) -> nn.Module:
    """Split onegpu's GPT over `tp_mesh` (1-D), in place, on the meta device."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleOutput,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    gather_after_norm = PrepareModuleOutput(
        output_layouts=Shard(1), desired_output_layouts=Replicate()
    )
    parallelize_module(
        model,
        tp_mesh,
        {
            "wte": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
            # positions 0..T-1: their rows reduce-scattered onto this process's part of T
            "wpe": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(0)),
            "norm_f": SequenceParallel(),
            "lm_head": ColwiseParallel(
                input_layouts=Shard(1), output_layouts=Shard(-1), use_local_output=False
            ),
        },
    )
    for block in model.blocks:
        plan = {}
        for branch, first, last in (("attn", ("q", "k", "v"), "proj"), ("mlp", ("fc",), "proj")):
            plan[f"{branch}.norm"] = SequenceParallel(use_local_output=False)
            for name in first:
                plan[f"{branch}.{name}"] = ColwiseParallel()
            plan[f"{branch}.{last}"] = RowwiseParallel(output_layouts=Shard(1))
        parallelize_module(block, tp_mesh, plan)
        for branch in (block.attn, block.mlp):
            parallelize_module(branch.norm, tp_mesh, gather_after_norm)
    model.tie_weights()  # the embedding and a tied output layer: one (vocabulary-sharded) weight
    if model.padded_vocab > model.vocab_size:
        model.lm_head.register_forward_hook(_mask_vocab_padding(model.vocab_size))
        model.lm_head.masks_padding = True
    return model


def _mask_vocab_padding(vocab_size: int):
    """A forward hook giving the padding columns of this process's logits -inf, as GPT.forward
    does for whole logits (a DTensor cannot be assigned into by a slice)."""
    from torch.distributed.tensor import DTensor

    def hook(module: nn.Module, args, logits: DTensor) -> DTensor:
        local = logits.to_local()
        width = local.shape[-1]
        first = logits.device_mesh.get_local_rank() * width
        columns = torch.arange(first, first + width, device=local.device)
        local = local.masked_fill(columns >= vocab_size, float("-inf"))
        return DTensor.from_local(local, logits.device_mesh, logits.placements, run_check=False)

    return hook


def vocab_parallel_loss(loss_fn: LossFn) -> LossFn:
    """`loss_fn` on vocabulary-sharded logits, its result a plain (replicated) tensor."""

    def loss(model: nn.Module, idx_BT: torch.Tensor, targets_BT: torch.Tensor) -> torch.Tensor:
        value = loss_fn(model, idx_BT, targets_BT)
        return value.to_local() if hasattr(value, "to_local") else value

    return loss


def loss_parallel_context() -> Callable[[], contextlib.AbstractContextManager]:
    """The context forward and backward of a tensor-parallel loss run in (`loss_parallel`
    replaces cross-entropy's ops for vocabulary-sharded logits, in both directions)."""
    from torch.distributed.tensor.parallel import loss_parallel

    return loss_parallel
