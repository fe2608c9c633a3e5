"""Blocked attention's causal softmax as onegpu's one-pass CPU kernel
(techniques/causal_softmax_cpu.py): ATen's bits, in the op the model calls."""

import pytest
import torch

from onegpu.models.blocked_attention import aten_causal_softmax, blocked_attention
from onegpu.techniques import causal_softmax_cpu


@pytest.mark.parametrize(
    ("shape", "start"),
    [
        ((4, 3, 128, 128), 0),
        ((4, 3, 128, 256), 128),
        ((2, 2, 64, 384), 320),
        ((2, 3, 5, 13), 8),
        ((2, 3, 37, 200), 163),  # rows of a vector body and a tail
    ],
)
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32])
def test_the_kernel_gives_atens_bits(shape, start, out_dtype):
    """Scaled, masked (query start + r sees keys up to start + r), softmaxed and cast in one
    pass: the same bits as ATen's add, softmax and cast, rows whose width is no multiple of the
    vector width included."""
    torch.manual_seed(0)
    scores = torch.randn(*shape) * 4
    assert causal_softmax_cpu.built()
    got = causal_softmax_cpu.causal_softmax(scores, start, 0.125, out_dtype)
    assert got.dtype == out_dtype
    assert torch.equal(got, aten_causal_softmax(scores, start, 0.125, out_dtype))


def test_any_layout_nan_scores_and_empty_blocks_as_atens_ops():
    """A transposed (non-contiguous) block; a NaN or +inf score where the mask hides it (ATen's
    add makes the row NaN); no keys at all (no crash)."""
    scores = torch.randn(2, 3, 64, 48).transpose(-1, -2) * 4
    want = aten_causal_softmax(scores, 20, 0.125, torch.bfloat16)
    assert torch.equal(causal_softmax_cpu.causal_softmax(scores, 20, 0.125, torch.bfloat16), want)
    hidden = torch.randn(1, 2, 8, 8)
    hidden[0, 0, 0, 5], hidden[0, 1, 2, 7] = float("nan"), float("inf")
    got = causal_softmax_cpu.causal_softmax(hidden, 0, 0.5, torch.float32)
    want = aten_causal_softmax(hidden, 0, 0.5, torch.float32)
    assert torch.equal(got.isnan(), want.isnan()) and got.isnan().any()
    assert torch.equal(got.nan_to_num(), want.nan_to_num())
    empty = torch.randn(2, 3, 4, 0)
    assert causal_softmax_cpu.causal_softmax(empty, 0, 1.0, torch.bfloat16).shape == (2, 3, 4, 0)


def test_blocked_attention_runs_the_kernel_and_gives_the_same_bits(monkeypatch):
    """Registered, the kernel is what blocked attention's softmax runs on a CPU; its output and
    gradients are those of ATen's ops (the kernel not built), bit for bit."""
    causal_softmax_cpu.register()
    calls = []
    real = causal_softmax_cpu.extension

    class Counting:
        def causal_softmax(self, *args):
            calls.append(args[1])
            return real().causal_softmax(*args)

    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 3, 256, 32, dtype=torch.bfloat16) for _ in range(3))

    def run():
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        y = blocked_attention(*leaves)
        y.float().square().sum().backward()
        return [y, *(t.grad for t in leaves)]

    monkeypatch.setattr(causal_softmax_cpu, "extension", Counting)
    with_kernel = run()
    assert calls, "the op did not run the kernel"
    monkeypatch.setattr(causal_softmax_cpu, "built", lambda: False)
    calls.clear()
    with_aten = run()
    assert not calls
    for a, b in zip(with_kernel, with_aten, strict=True):
        assert torch.equal(a, b)


def test_where_the_kernel_does_not_build_atens_ops_run(monkeypatch):
    def no_build():
        raise OSError("Python.h: No such file or directory")

    monkeypatch.setattr(causal_softmax_cpu, "extension", no_build)
    causal_softmax_cpu.built.cache_clear()
    try:
        scores = torch.randn(2, 16, 16)
        with pytest.warns(UserWarning, match="did not build.*Python.h"):
            got = causal_softmax_cpu.causal_softmax(scores, 0, 0.5, torch.bfloat16)
        assert torch.equal(got, aten_causal_softmax(scores, 0, 0.5, torch.bfloat16))
    finally:
        causal_softmax_cpu.built.cache_clear()
