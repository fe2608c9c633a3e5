"""torch.compile, whole or regional, applied after every module change (build.py's order).

- 'default' / 'max-autotune': the loss function (forward, output layer and cross-entropy) is
  compiled as one graph, so inductor can fuse the loss with the logits it consumes.
- 'regional': each transformer block is compiled in place (`nn.Module.compile`). The blocks run
  the same code on same-shaped inputs, so dynamo compiles the first one and reuses the result
  for the others: compile time does not grow with depth (what `nn.scan` over layers does in JAX,
  as Lippe's "Profiling and Scaling Single-GPU Transformer Models" shows). Embeddings, final
  norm and loss stay eager.

Compilation is lazy: nothing is compiled until the first step runs.
"""

from __future__ import annotations

import torch
from torch import nn

from onegpu.techniques.loss import LossFn


def apply_compile(model: nn.Module, loss_fn: LossFn, mode: str) -> LossFn:
    """Compile as `train.compile` says; returns the loss function to call."""
    if mode == "none":
        return loss_fn
    if mode == "regional":
        for block in model.blocks:
            block.compile()
        return loss_fn
    return torch.compile(loss_fn, mode=None if mode == "default" else mode)
