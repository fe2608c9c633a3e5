"""The training loss: summed next-token cross-entropy over the targets that count.

The loss is a *sum*; the step divides by the number of target tokens in the whole optimizer
batch, so that accumulated gradients equal the full-batch gradient exactly even when
micro-batches hold different numbers of real tokens (HF Trainer's long-standing bug,
transformers PR #34191). Logits are upcast to fp32 for the softmax.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from onegpu.data.windows import IGNORE_INDEX


def token_loss_sum(
    model: nn.Module, idx_BT: torch.Tensor, targets_BT: torch.Tensor
) -> torch.Tensor:
    """Sum of cross-entropy over targets != IGNORE_INDEX, in fp32."""
    return with_auxiliary(model, logits_loss_sum(model(idx_BT), targets_BT), targets_BT)


def logits_loss_sum(logits_BTV: torch.Tensor, targets_BT: torch.Tensor) -> torch.Tensor:
    """Sum of cross-entropy of these logits over targets != IGNORE_INDEX, in fp32 (what a
    pipeline's last stage computes from the logits it made)."""
    if logits_BTV.dtype in (torch.float16, torch.bfloat16):
        logits_BTV = logits_BTV.float()
    return F.cross_entropy(
        logits_BTV.flatten(0, 1),
        targets_BT.flatten(),
        ignore_index=IGNORE_INDEX,
        reduction="sum",
    )


def with_auxiliary(
    model: nn.Module, loss_sum: torch.Tensor, targets_BT: torch.Tensor
) -> torch.Tensor:
    """`loss_sum` plus the model's auxiliary term of this forward (a router's balancing loss),
    weighted by this micro-batch's counted tokens: the step divides the sum by the batch's
    tokens, so one micro-batch gives the model's own `mean + coef x aux`, and several weigh
    each micro-batch's term by its share of the tokens."""
    aux = model.auxiliary_loss()
    if aux is None:
        return loss_sum
    return loss_sum + aux.float() * (targets_BT != IGNORE_INDEX).sum()


def classification_loss_sum(
    model: nn.Module, idx_BT: torch.Tensor, labels_B1: torch.Tensor
) -> torch.Tensor:
    """Sum of a sequence classifier's cross-entropy over its labels (one per sequence, in the
    targets' first column), in fp32: the step divides by the number of labels in the batch."""
    logits_BC = model(idx_BT).float()
    return F.cross_entropy(logits_BC, labels_B1[:, 0], ignore_index=IGNORE_INDEX, reduction="sum")
