"""Chunked output layer + cross-entropy: the [tokens, vocab] logits never exist at once.

For GPT-2's 50,257-token vocabulary the fp32 logits are often the largest tensor of a step
(785 MiB for 8 x 512 tokens; docs/cpu-notes.md). Here the output projection and the loss run over chunks
of `memory.loss_chunk` tokens. Each chunk's gradient with respect to its logits
(softmax - onehot) is turned into gradients for the hidden states and the output weight right
away, in forward (as Liger-Kernel's fused linear cross-entropy does), so backward needs no
recomputation and only one chunk of logits is alive at any time. Same loss and gradients as
the plain path; under autocast the matmuls run in the autocast dtype, the softmax in fp32.
"""

from __future__ import annotations

import torch
from torch import nn

from onegpu.data.loader import IGNORE_INDEX
from onegpu.techniques.loss import LossFn


class ChunkedLinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx,
        h_ND,
        weight_VD,
        bias_V,
        targets_N,
        chunk: int,
        compute_dtype: torch.dtype,
        n_valid: int,
    ):
        device_type = h_ND.device.type
        with torch.autocast(device_type, enabled=False), torch.no_grad():
            w_VD = weight_VD.to(compute_dtype)
            grad_h_ND = torch.empty_like(h_ND)
            grad_w_VD = torch.zeros(weight_VD.shape, dtype=torch.float32, device=h_ND.device)
            grad_b_V = (
                torch.zeros(bias_V.shape, dtype=torch.float32, device=h_ND.device)
                if bias_V is not None
                else None
            )
            loss = torch.zeros((), dtype=torch.float32, device=h_ND.device)
            for s in range(0, h_ND.shape[0], chunk):
                h_cD = h_ND[s : s + chunk].to(compute_dtype)
                t_c = targets_N[s : s + chunk]
                logits_cV = (h_cD @ w_VD.T).float()
                if bias_V is not None:
                    logits_cV += bias_V.float()
                logits_cV[:, n_valid:] = float("-inf")  # vocabulary padding: probability 0
                valid_c = t_c != IGNORE_INDEX
                safe_t = t_c.clamp(min=0).unsqueeze(1)
                lse_c = logits_cV.logsumexp(dim=1)
                loss += ((lse_c - logits_cV.gather(1, safe_t).squeeze(1)) * valid_c).sum()
                # d(sum loss)/d(logits) = softmax - onehot(target), zero on ignored tokens
                g_cV = logits_cV.sub_(lse_c.unsqueeze(1)).exp_()
                g_cV.scatter_add_(1, safe_t, torch.full_like(safe_t, -1, dtype=g_cV.dtype))
                g_cV.mul_(valid_c.unsqueeze(1))
                if grad_b_V is not None:
                    grad_b_V += g_cV.sum(0)
                g_cV = g_cV.to(compute_dtype)
                grad_h_ND[s : s + chunk] = g_cV @ w_VD
                grad_w_VD += (g_cV.T @ h_cD).float()
                del logits_cV, g_cV
        ctx.save_for_backward(grad_h_ND, grad_w_VD, grad_b_V)
        ctx.weight_dtype = weight_VD.dtype
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        grad_h_ND, grad_w_VD, grad_b_V = ctx.saved_tensors
        gw = (grad_w_VD * grad_loss).to(ctx.weight_dtype)
        gb = (grad_b_V * grad_loss).to(ctx.weight_dtype) if grad_b_V is not None else None
        return grad_h_ND * grad_loss.to(grad_h_ND.dtype), gw, gb, None, None, None, None


def chunked_token_loss_sum(chunk: int) -> LossFn:
    """A loss function like `token_loss_sum`, with the output layer applied chunk by chunk."""

    def loss_fn(model: nn.Module, idx_BT: torch.Tensor, targets_BT: torch.Tensor) -> torch.Tensor:
        h_ND = model.hidden(idx_BT).flatten(0, 1)
        device_type = h_ND.device.type
        dtype = (
            torch.get_autocast_dtype(device_type)
            if torch.is_autocast_enabled(device_type)
            else h_ND.dtype
        )
        head = model.lm_head
        return ChunkedLinearCrossEntropy.apply(
            h_ND, head.weight, head.bias, targets_BT.flatten(), chunk, dtype, model.vocab_size
        )

    return loss_fn
