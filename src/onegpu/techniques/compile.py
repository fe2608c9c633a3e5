"""torch.compile, whole or regional, applied last: over the model with every technique in it.

- 'default' / 'max-autotune': the loss function (forward, output layer and cross-entropy) is
  compiled as one graph, so inductor can fuse the loss with the logits it consumes.
- 'regional': each transformer block is compiled in place (`nn.Module.compile`). The blocks run
  the same code on same-shaped inputs, so dynamo compiles the first one and reuses the result
  for the others: compile time does not grow with depth (seed 000's `nn.scan` over layers does
  the same for JAX). Embeddings, final norm and loss stay eager.
"""

from __future__ import annotations

import torch

from onegpu.models.gpt import GPT
from onegpu.techniques.loss import LossFn

COMPILE_MODES = ("none", "default", "max-autotune", "regional")


def apply_compile(model: GPT, loss_fn: LossFn, mode: str) -> LossFn:
    """Compile as `train.compile` says; returns the loss function to call."""
    if mode == "none":
        return loss_fn
    if mode == "regional":
        for block in model.blocks:
            block.compile()
        return loss_fn
    return torch.compile(loss_fn, mode=None if mode == "default" else mode)
