"""A compiled CPU linear's bias in oneDNN's GEMM epilogue (techniques/bias_epilogue.py): the
same bits as ATen's `addmm`, without its copy of the bias into the output."""

import pytest
import torch
from torch import nn

from onegpu.techniques import bias_epilogue
from onegpu.techniques.bias_epilogue import linear_bias, runs_as
from onegpu.techniques.compile import apply_compile

needs_onednn_bf16 = pytest.mark.skipif(
    not bias_epilogue.available(), reason="needs oneDNN's bf16 matmuls (AVX512-BF16 or AMX)"
)
BF16 = torch.bfloat16


@needs_onednn_bf16
@pytest.mark.parametrize(("rows", "k", "n"), [(512, 384, 1536), (512, 1536, 384), (96, 64, 192)])
def test_the_bias_in_the_epilogue_gives_addmms_bits(rows, k, n):
    """The fp32 accumulator plus the bias, rounded once to bf16: what ATen's addmm computes."""
    torch.manual_seed(0)
    x, w, b = torch.randn(rows, k, dtype=BF16), torch.randn(n, k, dtype=BF16), torch.randn(n)
    assert torch.equal(linear_bias(x, w, b.to(BF16)), torch.addmm(b.to(BF16), x, w.t()))


@needs_onednn_bf16
def test_the_floor_times_a_bf16_linears_addmm_as_the_compiled_run_does():
    x, w_KM = torch.randn(8, 16, dtype=BF16), torch.randn(32, 16, dtype=BF16).t()
    bias = torch.randn(32, dtype=BF16)
    op, args = runs_as(torch.ops.aten.addmm, [bias, x, w_KM])
    assert op is linear_bias and torch.equal(args[1], w_KM.t())


def test_other_products_are_timed_as_dispatched():
    """fp32, a bias that is no vector, a weight that is no transposed [out, in] tensor, `mm`:
    what ATen runs (whatever this CPU has)."""
    x, w_KM = torch.randn(8, 16, dtype=BF16), torch.randn(32, 16, dtype=BF16).t()
    bias = torch.randn(32, dtype=BF16)
    others = [
        [bias.float(), x.float(), w_KM.float()],
        [torch.randn(8, 32, dtype=BF16), x, w_KM],
        [bias, x, w_KM.contiguous()],
    ]
    for args in others:
        assert runs_as(torch.ops.aten.addmm, args)[0] is torch.ops.aten.addmm
    assert runs_as(torch.ops.aten.mm, [x, w_KM])[0] is torch.ops.aten.mm


def test_without_onednns_bf16_matmuls_no_pass_is_installed(monkeypatch):
    monkeypatch.setattr(bias_epilogue, "available", lambda: False)
    assert bias_epilogue.inductor_options(torch.device("cpu")) == {}
    if torch.cuda.is_available():
        assert bias_epilogue.inductor_options(torch.device("cuda")) == {}


@needs_onednn_bf16
def test_a_compiled_mlp_runs_its_linears_with_the_bias_in_the_epilogue():
    """Compiled as onegpu compiles (`apply_compile`, mode default), under bf16 autocast: each
    linear's forward is `onegpu::linear_bias`, and the output and the products' gradients
    (plain mms in the backward) are eager's bit for bit."""
    torch.manual_seed(0)
    mlp = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 64))
    x = torch.randn(128, 64)

    def forward(model, x):
        return model(x)

    def run(fn):
        mlp.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=BF16):
            y = fn(mlp, x)
        y.float().square().sum().backward()
        return y, [p.grad for p in mlp.parameters()]

    eager_y, eager_grads = run(forward)
    compiled = apply_compile(mlp, forward, "default", torch.device("cpu"))
    run(compiled)  # the compile, which dispatches the op on fake tensors too
    with torch.profiler.profile() as prof:
        compiled_y, compiled_grads = run(compiled)
    ran = [e for e in prof.events() if e.name == "onegpu::linear_bias"]
    assert len(ran) == 2
    assert torch.equal(compiled_y, eager_y)
    for (name, _), eager, got in zip(mlp.named_parameters(), eager_grads, compiled_grads):
        if name.endswith("weight"):
            assert torch.equal(got, eager), name
        else:  # the bias's gradient is a sum inductor orders its own way
            torch.testing.assert_close(got, eager, rtol=1e-2, atol=1e-2)


@needs_onednn_bf16
@pytest.mark.parametrize("mode", ["default", "regional"])
def test_compile_installs_the_pass_for_the_runs_device_before_the_weights_exist(mode, monkeypatch):
    """onegpu compiles a model still on the meta device (backends/torch/model.py): the pass
    follows the device the run is on, not where the weights are yet."""
    asked = []
    monkeypatch.setattr(torch, "compile", lambda fn, **kwargs: asked.append(kwargs) or fn)
    monkeypatch.setattr(nn.Module, "compile", lambda self, **kwargs: asked.append(kwargs))
    with torch.device("meta"):
        model = nn.Module()
        model.blocks = nn.ModuleList([nn.Linear(4, 4)])
    apply_compile(model, lambda model, x: x, mode, torch.device("cpu"))
    assert asked and all("post_grad_custom_post_pass" in a["options"] for a in asked)
    asked.clear()
    apply_compile(model, lambda model, x: x, mode, torch.device("meta"))
    assert asked and not any(a.get("options") for a in asked)
