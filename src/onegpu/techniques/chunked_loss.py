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
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from onegpu.cache import peek
from onegpu.config import ModelConfig
from onegpu.data.windows import IGNORE_INDEX
from onegpu.models.protocol import LossFn
from onegpu.perf.contention import follows_last_run, timed_cached
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
    untimed_chunk,
    valid_timings,
    worth_chunking,
)
from onegpu.techniques.loss import with_auxiliary
from onegpu.techniques.loss_kernels import LossKernels, add_product


@dataclass(frozen=True, slots=True)
class VocabShard:
    """This process's columns of a vocabulary split over `group` (tensor parallelism): the
    softmax's max, normaliser and target logit are summed over the group, a few numbers per
    token, while the [chunk, vocab] block stays 1/tp wide."""

    group: Any
    first: int  # the vocabulary index of this process's first column


def _softmax_grad(
    logits_cV: torch.Tensor, safe_t: torch.Tensor, valid_c1: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(summed loss, d loss / d logits = softmax - onehot) of a chunk over the whole vocabulary.
    One fused softmax kernel; the log-sum-exp as max - log(max softmax): the largest probability
    is >= 1 / vocab, so its log is exact; no exp pass of our own over the [chunk, vocab] block."""
    max_c = logits_cV.amax(dim=1)
    g_cV = torch.softmax(logits_cV, dim=1)
    lse_c = max_c - g_cV.amax(dim=1).log()
    target_c = logits_cV.gather(1, safe_t).squeeze(1)
    loss = ((lse_c - target_c) * valid_c1.squeeze(1)).sum()
    g_cV.scatter_add_(1, safe_t, valid_c1.to(g_cV.dtype).neg())
    return loss, g_cV


def _sharded_softmax_grad(
    logits_cV: torch.Tensor, safe_t: torch.Tensor, valid_c1: torch.Tensor, shard: VocabShard
) -> tuple[torch.Tensor, torch.Tensor]:
    """`_softmax_grad` on this process's columns (Megatron's vocabulary-parallel cross-entropy):
    three all-reduces of [chunk] numbers; every process gets the same loss."""
    import torch.distributed as dist

    width = logits_cV.shape[1]
    local_t = safe_t - shard.first
    mine_c1 = (local_t >= 0) & (local_t < width)
    local_t = local_t.clamp(0, width - 1)
    max_c = logits_cV.amax(dim=1)
    dist.all_reduce(max_c, dist.ReduceOp.MAX, group=shard.group)
    target_c = (logits_cV.gather(1, local_t) * mine_c1).squeeze(1)
    g_cV = logits_cV.sub_(max_c.unsqueeze(1)).exp_()  # the logits are not needed again
    sum_c = g_cV.sum(dim=1)
    dist.all_reduce(sum_c, group=shard.group)
    dist.all_reduce(target_c, group=shard.group)
    g_cV /= sum_c.unsqueeze(1)
    loss = ((max_c + sum_c.log() - target_c) * valid_c1.squeeze(1)).sum()
    g_cV.scatter_add_(1, local_t, (valid_c1 & mine_c1).to(g_cV.dtype).neg())
    return loss, g_cV


VOCAB_BLOCK = 32768
"""Rows of the output weight whose fp32 gradient a chunk adds at a time (fp32 weights under
autocast): the 16-bit product and its fp32 copy stay this many rows, not the whole vocabulary
(3 GiB for Llama-3's 128k x 4096 head)."""


def _add_weight_grad(
    grad_w_VD: torch.Tensor, g_cV: torch.Tensor, h_cD: torch.Tensor, kernels: LossKernels | None
) -> None:
    """grad_w += g^T h without a [vocab, d_model] temporary: straight into the gradient where
    it has the matmul's dtype (fp32; 16-bit weights, whose gradient is summed in their own
    dtype over the chunks, as autograd sums a chunked loss's), else a block of rows at a
    time (by the compiled kernel where there is one: product and sum in one pass)."""
    if grad_w_VD.dtype == g_cV.dtype:
        grad_w_VD.addmm_(g_cV.T, h_cD)
        return
    add = kernels.add_product if kernels is not None else add_product
    for v in range(0, grad_w_VD.shape[0], VOCAB_BLOCK):
        add(grad_w_VD[v : v + VOCAB_BLOCK], g_cV[:, v : v + VOCAB_BLOCK].T, h_cD)


@dataclass(slots=True)
class _Chunks:
    """What every chunk of one forward shares: the vocabulary's extent, the kernels, and the
    bias's fp32 gradient being summed."""

    padding: int  # this process's first padding column (the vocabulary's end on its columns)
    compute_dtype: torch.dtype
    shard: VocabShard | None
    kernels: LossKernels | None
    bias_V: torch.Tensor | None
    grad_b_V: torch.Tensor | None

    def loss_and_grad(
        self, h_cD: torch.Tensor, w_VD: torch.Tensor, safe_t: torch.Tensor, valid_c1: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(the chunk's summed loss, d loss / d logits in the compute dtype), by the fused
        kernel where it applies (the whole vocabulary here, no bias), else by ATen's (the
        16-bit logits freed as soon as their fp32 copy exists)."""
        if self.kernels is not None and self.shard is None and self.bias_V is None:
            return self.kernels.softmax_grad(
                h_cD @ w_VD.T, safe_t, valid_c1, self.padding, self.compute_dtype
            )
        logits_cV = (h_cD @ w_VD.T).float()
        if self.bias_V is not None:
            logits_cV += self.bias_V.float()
        logits_cV[:, max(self.padding, 0) :] = float("-inf")  # vocabulary padding: p = 0
        if self.shard is None:
            loss_c, g_cV = _softmax_grad(logits_cV, safe_t, valid_c1)
        else:
            loss_c, g_cV = _sharded_softmax_grad(logits_cV, safe_t, valid_c1, self.shard)
        del logits_cV
        if self.grad_b_V is not None:
            self.grad_b_V += g_cV.T @ valid_c1.squeeze(1).to(g_cV.dtype)
        return loss_c, g_cV.to(self.compute_dtype)


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
        shard: VocabShard | None = None,
        kernels: LossKernels | None = None,
    ):
        with torch.autocast(h_ND.device.type, enabled=False), torch.no_grad():
            w_VD = weight_VD.to(compute_dtype)
            grad_h_ND = torch.empty_like(h_ND)
            # the weight's gradient in fp32, or in the weight's own 16-bit dtype (bf16-pure):
            # then it costs what the gradient costs anyway, not twice that
            grad_dtype = torch.float32 if weight_VD.dtype == torch.float32 else weight_VD.dtype
            grad_w_VD = torch.zeros(weight_VD.shape, dtype=grad_dtype, device=h_ND.device)
            grad_b_V = (
                torch.zeros(bias_V.shape, dtype=torch.float32, device=h_ND.device)
                if bias_V is not None
                else None
            )
            loss = torch.zeros((), dtype=torch.float32, device=h_ND.device)
            fp32 = compute_dtype == torch.float32 == h_ND.dtype
            padding = n_valid - (shard.first if shard else 0)  # this process's first padding
            chunks = _Chunks(padding, compute_dtype, shard, kernels, bias_V, grad_b_V)
            for s in range(0, h_ND.shape[0], chunk):
                t_c = targets_N[s : s + chunk]
                valid_c1 = (t_c != IGNORE_INDEX).unsqueeze(1)
                # ignored tokens are masked on the [chunk, d_model] side, never on the
                # [chunk, vocab] one: their hidden rows are zeroed for the weight gradient and
                # their rows of the hidden-state gradient below
                h_cD = h_ND[s : s + chunk].to(compute_dtype) * valid_c1
                safe_t = t_c.clamp(min=0).unsqueeze(1)
                loss_c, g_cV = chunks.loss_and_grad(h_cD, w_VD, safe_t, valid_c1)
                loss += loss_c
                if fp32:  # straight into the hidden states' gradient: no temporary
                    torch.mm(g_cV, w_VD, out=grad_h_ND[s : s + chunk])
                else:
                    grad_h_ND[s : s + chunk] = g_cV @ w_VD
                _add_weight_grad(grad_w_VD, g_cV, h_cD, kernels)
                grad_h_ND[s : s + chunk] *= valid_c1
                del g_cV
        ctx.save_for_backward(grad_h_ND, grad_w_VD, grad_b_V)
        ctx.weight_dtype = weight_VD.dtype
        return loss

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_loss):
        """The gradients made in forward, scaled by the loss's; the weight's in place (this
        backward runs once: no [vocab, d_model] copy), then in the weight's dtype."""
        grad_h_ND, grad_w_VD, grad_b_V = ctx.saved_tensors
        gw = grad_w_VD.mul_(grad_loss).to(ctx.weight_dtype)  # a no-op cast where it matches
        gb = (grad_b_V * grad_loss).to(ctx.weight_dtype) if grad_b_V is not None else None
        grad_h = grad_h_ND * grad_loss.to(grad_h_ND.dtype)
        return grad_h, gw, gb, None, None, None, None, None, None


def chunked_token_loss_sum(chunk: int, kernels: LossKernels | None = None) -> LossFn:
    """A loss function like `token_loss_sum`, with the output layer applied chunk by chunk (each
    chunk's math by `kernels`, or ATen's)."""

    def loss_fn(model: nn.Module, idx_BT: torch.Tensor, targets_BT: torch.Tensor) -> torch.Tensor:
        h_ND = model.hidden(idx_BT).flatten(0, 1)
        head = model.lm_head
        loss = ChunkedLinearCrossEntropy.apply(
            h_ND,
            head.weight,
            head.bias,
            targets_BT.flatten(),
            chunk,
            compute_dtype(h_ND),
            model.vocab_size,
            None,
            kernels,
        )
        return with_auxiliary(model, loss, targets_BT)

    return loss_fn


def vocab_parallel_chunked_loss(chunk: int) -> LossFn:
    """The chunked output layer and cross-entropy on this process's vocabulary rows: the hidden
    states gathered once over the sequence (as the plain output layer gathers them; whole
    already without sequence parallelism), each chunk's logits 1/tp wide, the loss the same on every process. The
    hidden states' gradient is each process's partial sum, reduce-scattered back onto the
    sequence."""
    from torch.distributed.tensor import DTensor, Partial, Replicate

    @torch._dynamo.disable  # collectives inside an autograd.Function: eager under compile
    def loss(model: nn.Module, idx_BT: torch.Tensor, targets_BT: torch.Tensor) -> torch.Tensor:
        head = model.lm_head
        mesh = head.weight.device_mesh
        h_BTD = model.hidden(idx_BT)
        if not isinstance(h_BTD, DTensor):  # no sequence parallelism (an HF model's plan)
            h_BTD = DTensor.from_local(h_BTD, mesh, [Replicate()], run_check=False)
        h_BTD = h_BTD.redistribute(mesh, [Replicate()]).to_local(grad_placements=[Partial()])
        w_VD = head.weight.to_local()
        bias_V = head.bias.to_local() if head.bias is not None else None
        shard = VocabShard(mesh.get_group(), mesh.get_local_rank() * w_VD.shape[0])
        dtype = compute_dtype(h_BTD)
        value = ChunkedLinearCrossEntropy.apply(
            h_BTD.flatten(0, 1),
            w_VD,
            bias_V,
            targets_BT.flatten(),
            chunk,
            dtype,
            model.vocab_size,
            shard,
        )
        return with_auxiliary(model, value, targets_BT)

    return loss


def compute_dtype(h: torch.Tensor) -> torch.dtype:
    """The dtype the output layer's matmuls run in: autocast's, else the hidden states'."""
    device_type = h.device.type
    if torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    return h.dtype


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
    takes untimed_chunk's size wherever the share calls for chunking)."""
    if value != "auto":
        return int(value)
    bytes_ = torch.empty((), dtype=dtype).element_size()
    if not chunkable or not worth_chunking(m, tokens, bytes_):
        return 0
    vocab = padded_vocab(m)
    here = device.type == "cpu" or (device.type == "cuda" and torch.cuda.is_available())
    if not timed and not here:
        return untimed_chunk(tokens)
    key = f"{device_key(device)}|{dtype}|tokens={tokens}|d={m.d_model}|vocab={vocab}"
    if not timed:  # a plan: what a run here chose, if one did
        found = peek("loss_chunk.json", key, valid=valid_timings, provisional=follows_last_run())
        return chosen_chunk(found, tokens) if found else untimed_chunk(tokens)
    found = timed_cached(
        "loss_chunk.json",
        key,
        lambda: measure_loss_chunk(tokens, m.d_model, vocab, dtype, device),
        what="the loss chunk (memory.loss_chunk auto)",
        valid=valid_timings,
    )
    return chosen_chunk(found, tokens)
