"""Gradient accumulation equals the full-batch gradient, padding and uneven micro-batches too."""

import torch
from conftest import accumulate

from onegpu.backends.torch.loader import IGNORE_INDEX, count_targets
from onegpu.models.gpt import GPT
from onegpu.techniques.loss import token_loss_sum


def _grads(model, x, y, n_micro):
    """Gradients of one batch accumulated over n_micro micro-batches by the production step."""
    loss = accumulate(model, x, y, n_micro)
    return loss, [p.grad.clone() for p in model.parameters()]


def _batch_with_uneven_padding(B=8, T=32):
    x = torch.randint(0, 256, (B, T))
    y = torch.randint(0, 256, (B, T))
    # Real lengths differ a lot: micro-batch 0 is nearly all padding, micro-batch 3 has none.
    lengths = [2, 3, 10, 31, 20, 5, 32, 32]
    for i, n in enumerate(lengths):
        y[i, n:] = IGNORE_INDEX
    return x, y


def _rel(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    """Relative difference of the whole gradient (per tensor it would divide by the key bias's
    gradient, which is zero up to rounding: softmax ignores what adds to every score alike)."""
    flat_a = torch.cat([p.flatten() for p in a])
    flat_b = torch.cat([q.flatten() for q in b])
    return ((flat_a - flat_b).norm() / flat_b.norm()).item()


def test_accumulated_equals_full_batch_gradient_in_fp64(tiny_cfg):
    tiny_cfg.model.dropout = 0.0
    model = GPT(tiny_cfg.model).double()  # fp64 reference removes summation-order noise
    model.init_weights()
    x, y = _batch_with_uneven_padding()
    full_loss, full = _grads(model, x, y, n_micro=1)
    for k in (2, 4, 8):
        loss, acc = _grads(model, x, y, n_micro=k)
        torch.testing.assert_close(loss, full_loss, rtol=1e-12, atol=0)
        for a, b in zip(acc, full, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-14)


def test_accumulated_equals_full_batch_where_averaging_means_would_not(tiny_cfg):
    """fp32, the same uneven batch: the step's token-normalised accumulation matches the full
    batch to float rounding, while averaging per-micro-batch mean losses (HF Trainer's old bug,
    transformers PR #34191) misses it by over 1%: the batch does tell the two apart."""
    model = GPT(tiny_cfg.model)
    model.init_weights()
    x, y = _batch_with_uneven_padding()
    _, full = _grads(model, x, y, n_micro=1)
    _, acc = _grads(model, x, y, n_micro=4)
    assert _rel(acc, full) < 1e-6
    model.zero_grad(set_to_none=True)
    for xb, yb in zip(x.chunk(4), y.chunk(4), strict=True):
        (token_loss_sum(model, xb, yb) / count_targets(yb) / 4).backward()
    naive = [p.grad for p in model.parameters()]
    assert _rel(naive, full) > 1e-2
