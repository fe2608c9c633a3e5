"""`train.gelu_kernel`: the compiled tanh GELU computes what ATen's does (forward and
backward, rounding apart), runs where a run says compiled, and `auto` compiles only where a
timing says the run wins the compile back, and says why where it did not time."""

import pytest
import torch
import torch.nn.functional as F

from onegpu.backends.torch.build import build
from onegpu.config import load_config
from onegpu.models.gpt import TanhGELU
from onegpu.techniques import gelu_kernel
from onegpu.techniques.gelu_kernel import GeluShape, compiled_gelu, resolve_gelu_kernel

CPU = torch.device("cpu")
TIMING = {"eager_s": 0.008, "compiled_s": 0.004, "compile_s": 5.0}


def _refuse(*args, **kwargs):
    raise AssertionError("timed where it should not have")


def test_compiled_gelu_computes_what_atens_computes():
    """In bf16, output and input gradient are as close to the exact GELU (fp64) as ATen's,
    to within one bf16 rounding; the same function, the same dtype out."""
    g = torch.Generator().manual_seed(0)
    x64 = torch.randn(64, 96, generator=g, dtype=torch.float64) * 3
    dy64 = torch.randn(64, 96, generator=g, dtype=torch.float64)
    exact = x64.clone().requires_grad_()
    F.gelu(exact, approximate="tanh").backward(dy64)

    results = {}
    for name, fn in (
        ("aten", lambda t: F.gelu(t, approximate="tanh")),
        ("compiled", compiled_gelu),
    ):
        x = x64.to(torch.bfloat16).requires_grad_()
        y = fn(x)
        y.backward(dy64.to(torch.bfloat16))
        assert y.dtype == x.grad.dtype == torch.bfloat16
        results[name] = (y.double(), x.grad.double())
    # against the exact values at the bf16 inputs
    x_rounded = x64.to(torch.bfloat16).double().requires_grad_()
    want_y = F.gelu(x_rounded, approximate="tanh")
    want_y.backward(dy64.to(torch.bfloat16).double())
    ulp = 2.0**-7  # bf16's relative spacing
    for got, want in zip(results["compiled"], (want_y.detach(), x_rounded.grad), strict=True):
        assert torch.allclose(got, want, rtol=2 * ulp, atol=1e-3)
    for ours, atens in zip(results["compiled"], results["aten"], strict=True):
        assert (ours - atens).abs().max() <= 2 * ulp * atens.abs().max()
    assert exact.grad is not None  # (the fp64 reference ran through autograd too)


def test_resolve_times_once_and_follows_the_rule(monkeypatch, tmp_path):
    """Timed once per shape (cached), compiled where the saving over the run's calls beats
    the compile; a short run keeps ATen's and says so."""
    monkeypatch.setenv("ONEGPU_CACHE", str(tmp_path))
    calls: list[GeluShape] = []
    monkeypatch.setattr(
        gelu_kernel, "measure_gelu_kernel", lambda shape, device: calls.append(shape) or TIMING
    )
    shape = GeluShape(tokens=4096, hidden=1536, dtype=torch.bfloat16)
    # 4 ms saved a call: 5 s of compiling pays after 1,250 calls
    assert resolve_gelu_kernel("auto", shape, CPU, 2000)[0] == "compiled"
    choice, timing = resolve_gelu_kernel("auto", shape, CPU, 1000)
    assert choice == "eager" and timing["compiled_s"] == TIMING["compiled_s"]
    assert calls == [shape]  # the second read the cache
    assert resolve_gelu_kernel("eager", shape, CPU, 10**6) == ("eager", None)
    assert resolve_gelu_kernel("auto", shape, CPU, 10**6, skipped="why") == (
        "eager",
        {"skipped": "why"},
    )


def _cfg(**over):
    base = {"train.device": "cpu", "train.precision": "fp32", "model.dropout": "0.0",
            "out.progress": "false", "train.compile": "none"}  # fmt: skip
    return load_config("tiny", overrides=base | {k: str(v) for k, v in over.items()})


def test_a_run_takes_the_compiled_kernel_and_says_so(monkeypatch, tmp_path):
    """A long eager run takes the cached choice: every GELU of the model runs the compiled
    kernel, and its loss and gradients are the eager model's; the first line says why."""
    from onegpu.backends.torch.report import describe_auto, kernel_record

    monkeypatch.setenv("ONEGPU_CACHE", str(tmp_path))
    monkeypatch.setattr(gelu_kernel, "measure_gelu_kernel", lambda *a: dict(TIMING))
    cfg = _cfg(**{"train.max_steps": "3000"})
    built = build(cfg, CPU, with_data=False)
    assert built.cfg.train.gelu_kernel == "compiled"
    gelus = [m for m in built.model.modules() if isinstance(m, TanhGELU)]
    assert gelus and all(m.kernel is compiled_gelu for m in gelus)
    assert (
        "GELU kernel compiled (a layer's GELU forward + backward: eager 8.00 ms, compiled 4.00 ms"
        in (describe_auto(built))
    )
    assert kernel_record(built.resolved.gelu_kernel_timing, "compiled")["chosen"] == "compiled"

    eager = build(
        _cfg(**{"train.max_steps": "3000", "train.gelu_kernel": "eager"}), CPU, with_data=False
    )
    assert all(m.kernel is None for m in eager.model.modules() if isinstance(m, TanhGELU))
    x = torch.randint(0, cfg.model.vocab_size, (2, 16))
    losses, grads = [], []
    for b in (built, eager):
        loss = b.loss_fn(b.model, x, x)
        loss.backward()
        losses.append(loss.detach())
        grads.append([p.grad.clone() for p in b.model.parameters() if p.grad is not None])
    torch.testing.assert_close(losses[0], losses[1], rtol=1e-5, atol=1e-6)
    for ours, theirs in zip(grads[0], grads[1], strict=True):
        torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize(
    ("over", "why"),
    [
        ({"train.max_steps": "10"}, "micro-batches, under 100"),
        ({"train.max_steps": "3000", "train.compile": "regional"}, "regional fuses the GELU"),
        ({"train.max_steps": "3000", "memory.gelu_bits": "2"}, "few-bit GELU"),
    ],
)
def test_auto_says_why_it_did_not_time(monkeypatch, tmp_path, over, why):
    from onegpu.backends.torch.resolve import resolve

    monkeypatch.setenv("ONEGPU_CACHE", str(tmp_path))
    monkeypatch.setattr(gelu_kernel, "measure_gelu_kernel", _refuse)
    resolved = resolve(_cfg(**over), CPU)
    assert resolved.config.train.gelu_kernel == "eager"
    assert why in resolved.gelu_kernel_timing["skipped"]


def test_compiled_by_hand_on_a_compiled_model_warns_that_the_graph_runs_instead(tmp_path):
    from onegpu.backends.torch.resolve import resolve

    cfg = _cfg(**{"train.compile": "regional", "train.gelu_kernel": "compiled"})
    with pytest.warns(UserWarning, match="regional fuses the GELU into its graph"):
        assert resolve(cfg, CPU).config.train.gelu_kernel == "compiled"


@pytest.mark.slow
def test_the_timing_runs_both_kernels():
    """The real timing (fast tests record the compile as failed: conftest.py)."""
    found = gelu_kernel.measure_gelu_kernel(GeluShape(256, 384, torch.bfloat16), CPU)
    assert all(found[k] > 0 for k in ("eager_s", "compiled_s")) and found["compile_s"] >= 0
