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

import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from onegpu.cache import cached, peek
from onegpu.config import ModelConfig
from onegpu.data.windows import IGNORE_INDEX
from onegpu.models.protocol import LossFn
from onegpu.perf.devices import device_key, sync
from onegpu.perf.logits import (  # noqa: F401 - the rule, shared with the JAX backend
    CHUNK_SIZES,
    MIN_LOGITS_BYTES,
    MIN_LOGITS_SHARE,
    UNTIMED_CHUNK,
    chosen_chunk,
    leanest_within_margin,
    logits_share,
    padded_vocab,
    plain_logits_bytes,
    valid_timings,
    worth_chunking,
)
from onegpu.techniques.loss import with_auxiliary


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
            fp32 = compute_dtype == torch.float32 == h_ND.dtype
            for s in range(0, h_ND.shape[0], chunk):
                t_c = targets_N[s : s + chunk]
                valid_c1 = (t_c != IGNORE_INDEX).unsqueeze(1)
                # ignored tokens are masked on the [chunk, d_model] side, never on the
                # [chunk, vocab] one: their hidden rows are zeroed for the weight gradient and
                # their rows of the hidden-state gradient below
                h_cD = h_ND[s : s + chunk].to(compute_dtype) * valid_c1
                safe_t = t_c.clamp(min=0).unsqueeze(1)
                logits_cV = (h_cD @ w_VD.T).float()
                if bias_V is not None:
                    logits_cV += bias_V.float()
                logits_cV[:, n_valid:] = float("-inf")  # vocabulary padding: probability 0
                # one fused softmax kernel gives d(sum loss)/d(logits) = softmax - onehot, and
                # the log-sum-exp as max - log(max softmax): the largest probability is >= 1 /
                # vocab, so its log is exact; no exp pass of our own over the [chunk, vocab] block
                max_c = logits_cV.amax(dim=1)
                g_cV = torch.softmax(logits_cV, dim=1)
                lse_c = max_c - g_cV.amax(dim=1).log()
                loss += (
                    (lse_c - logits_cV.gather(1, safe_t).squeeze(1)) * valid_c1.squeeze(1)
                ).sum()
                del logits_cV
                g_cV.scatter_add_(1, safe_t, valid_c1.to(g_cV.dtype).neg())
                if grad_b_V is not None:
                    grad_b_V += g_cV.T @ valid_c1.squeeze(1).to(g_cV.dtype)
                g_cV = g_cV.to(compute_dtype)
                if fp32:  # straight into the gradients: no [vocab, d_model] temporary
                    torch.mm(g_cV, w_VD, out=grad_h_ND[s : s + chunk])
                    grad_w_VD.addmm_(g_cV.T, h_cD)
                else:
                    grad_h_ND[s : s + chunk] = g_cV @ w_VD
                    grad_w_VD += (g_cV.T @ h_cD).float()
                grad_h_ND[s : s + chunk] *= valid_c1
                del g_cV
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
        loss = ChunkedLinearCrossEntropy.apply(
            h_ND, head.weight, head.bias, targets_BT.flatten(), chunk, dtype, model.vocab_size
        )
        return with_auxiliary(model, loss, targets_BT)

    return loss_fn


# ---------------------------------------------------------------------------- memory.loss_chunk auto


def measure_loss_chunk(
    tokens: int, d_model: int, vocab: int, dtype: torch.dtype, device: torch.device
) -> dict[str, Any]:
    """Time output layer + loss forward and backward, plain and per chunk size, interleaved; the
    minimum of 3 rounds each (other work on the machine only ever slows a run down)."""
    g = torch.Generator(device="cpu").manual_seed(0)
    h_ND = torch.randn(tokens, d_model, generator=g).to(device, dtype).requires_grad_()
    w_VD = (torch.randn(vocab, d_model, generator=g) * 0.02).to(device, dtype).requires_grad_()
    t_N = torch.randint(0, vocab, (tokens,), generator=g).to(device)

    def plain() -> torch.Tensor:
        logits = (h_ND @ w_VD.T).float()
        return F.cross_entropy(logits, t_N, reduction="sum")

    def chunked(c: int) -> Callable[[], torch.Tensor]:
        return lambda: ChunkedLinearCrossEntropy.apply(h_ND, w_VD, None, t_N, c, dtype, vocab)

    # a chunk of the whole micro-batch keeps what the plain loss keeps: not a contestant
    contestants = {0: plain} | {c: chunked(c) for c in CHUNK_SIZES if c < tokens}
    times: dict[int, list[float]] = {c: [] for c in contestants}
    for _ in range(4):  # the first round warms up (allocations, kernel selection)
        for c, fn in contestants.items():
            sync(device)
            t0 = time.perf_counter()
            fn().backward()
            sync(device)
            times[c].append(time.perf_counter() - t0)
            h_ND.grad = w_VD.grad = None
    seconds = {str(c): round(min(ts[1:]), 5) for c, ts in times.items()}
    return {"chunk": leanest_within_margin(seconds), "seconds": seconds}


def resolve_loss_chunk(
    value: int | str,
    m: ModelConfig,
    tokens: int,
    dtype: torch.dtype,
    device: torch.device,
    *,
    chunkable: bool = True,
    timed: bool = True,
) -> int:
    """The chunk size `memory.loss_chunk` stands for: itself unless 'auto'. `chunkable`: the
    model's loss has vocabulary-sized logits the chunked loss computes exactly (not a classifier,
    no logit transform). `timed`: the device is here to time on (a plan for an absent GPU
    takes UNTIMED_CHUNK wherever the share calls for chunking)."""
    if value != "auto":
        return int(value)
    bytes_ = torch.empty((), dtype=dtype).element_size()
    if not chunkable or not worth_chunking(m, tokens, bytes_):
        return 0
    vocab = padded_vocab(m)
    here = device.type == "cpu" or (device.type == "cuda" and torch.cuda.is_available())
    if not timed and not here:
        return UNTIMED_CHUNK
    key = f"{device_key(device)}|{dtype}|tokens={tokens}|d={m.d_model}|vocab={vocab}"
    if not timed:  # a plan: what a run here chose, if one did
        found = peek("loss_chunk.json", key, valid=valid_timings)
        return chosen_chunk(found, tokens) if found else UNTIMED_CHUNK
    found = cached(
        "loss_chunk.json",
        key,
        lambda: measure_loss_chunk(tokens, m.d_model, vocab, dtype, device),
        valid=valid_timings,
    )
    return chosen_chunk(found, tokens)
