"""Gradient accumulation equals the full-batch gradient, padding and uneven micro-batches too."""

import torch

from onegpu.data.loader import IGNORE_INDEX, count_targets
from onegpu.models.gpt import GPT
from onegpu.techniques.loss import token_loss_sum
from onegpu.techniques.precision import resolve_precision
from onegpu.train.step import forward_backward


def _grads(model, x, y, n_micro):
    model.zero_grad(set_to_none=True)
    policy = resolve_precision("fp32", torch.device("cpu"))
    scaler = policy.grad_scaler(torch.device("cpu"))
    loss = forward_backward(
        model, token_loss_sum, policy, scaler, x, y, n_micro=n_micro, n_tokens=count_targets(y)
    )
    return loss, [p.grad.clone() for p in model.parameters()]


def _batch_with_uneven_padding(B=8, T=32):
    x = torch.randint(0, 256, (B, T))
    y = torch.randint(0, 256, (B, T))
    # Real lengths differ a lot: micro-batch 0 is nearly all padding, micro-batch 3 has none.
    lengths = [2, 3, 10, 31, 20, 5, 32, 32]
    for i, n in enumerate(lengths):
        y[i, n:] = IGNORE_INDEX
    return x, y


def test_accumulated_equals_full_batch_gradient(tiny_cfg):
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


def test_accumulated_equals_full_batch_fp32(tiny_cfg):
    model = GPT(tiny_cfg.model)
    model.init_weights()
    x, y = _batch_with_uneven_padding()
    _, full = _grads(model, x, y, n_micro=1)
    _, acc = _grads(model, x, y, n_micro=4)
    for a, b in zip(acc, full, strict=True):
        rel = (a - b).norm() / b.norm()
        assert rel < 1e-6, rel


def test_averaging_micro_batch_means_would_be_wrong(tiny_cfg):
    """The bug this design avoids: averaging per-micro-batch mean losses weights tokens unevenly."""
    model = GPT(tiny_cfg.model)
    model.init_weights()
    x, y = _batch_with_uneven_padding()
    _, full = _grads(model, x, y, n_micro=1)
    model.zero_grad(set_to_none=True)
    for xb, yb in zip(x.chunk(4), y.chunk(4), strict=True):
        (token_loss_sum(model, xb, yb) / count_targets(yb) / 4).backward()
    naive = [p.grad for p in model.parameters()]
    rel = max(((a - b).norm() / b.norm()).item() for a, b in zip(naive, full, strict=True))
    assert rel > 1e-2
