"""What a model offers onegpu's techniques, typed: our GPT and the Hugging Face adapter both
declare it, so techniques, losses and tools read attributes instead of probing with
getattr/hasattr.

- `blocks`: the repeated transformer blocks (checkpointing, regional compile, FSDP units)
- `hidden(idx_BT)`: final-normed hidden states [B, T, D] (the chunked loss applies the head)
- `lm_head`: the output layer, a Linear (vocabulary or classes)
- `vocab_size`: rows of the output that are real tokens (targets lie below it);
  `padded_vocab`: its rows with the padding for matrix units
- `cfg`: the resolved ModelConfig
- `is_classifier`: a sequence classifier (targets are labels, one per row)
- `last_auxiliary`: the auxiliary term the last step took (the log shows it); None where none
- `logit_transform`: the config attribute by which the model changes its logits after the
  head (soft-capping, scaling), which a chunked loss would skip; None where there is none
- `use_positions(positions_BT)`: rows of packed documents for the next forwards
- `init_weights()`: initialise in place (after materialisation); `tie_weights()`: re-tie
  shared input/output weights after parameters were replaced; `padding_params()`: parameters
  that only pad the vocabulary
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol, runtime_checkable

import torch
from torch import nn

from onegpu.config import ModelConfig

LossFn = Callable[[nn.Module, torch.Tensor, torch.Tensor], torch.Tensor]
"""A loss over a model: loss_fn(model, idx_BT, targets_BT) -> the summed loss (a scalar)."""


@runtime_checkable
class LanguageModel(Protocol):
    blocks: nn.ModuleList
    lm_head: nn.Module
    vocab_size: int
    padded_vocab: int
    cfg: ModelConfig
    is_classifier: bool
    logit_transform: str | None
    last_auxiliary: torch.Tensor | None
    """The auxiliary term `auxiliary_loss` took last (detached, for the log line); None: none."""

    def hidden(self, idx_BT: torch.Tensor) -> torch.Tensor: ...

    def use_positions(self, positions_BT: torch.Tensor | None) -> None:
        """The next forwards' rows pack documents with these positions, each attending only
        within itself (models/documents.py); None: one document a row."""
        ...

    def init_weights(self) -> None: ...

    def tie_weights(self) -> None: ...

    def padding_params(self) -> int:
        """Parameters that only pad the vocabulary (counted in no model size)."""
        ...

    def auxiliary_loss(self) -> torch.Tensor | None:
        """A term the last forward adds to the mean loss (a mixture of experts' router
        balancing loss, already scaled by its coefficient), taken once; None: none."""
        ...

    # nn.Module's own surface, used alongside
    def parameters(self, recurse: bool = True): ...

    def __call__(self, idx_BT: torch.Tensor) -> torch.Tensor: ...
