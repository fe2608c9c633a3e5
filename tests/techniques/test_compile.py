"""Compiled steps (whole and regional) equal eager ones."""

import pytest
import torch

from onegpu.backends.torch.build import build


def _loss_and_grads(cfg, x):
    built = build(cfg, with_data=False)
    loss = built.step.forward_backward(x[:, :-1], x[:, 1:], x[:, 1:].numel())
    return loss.item(), {n: p.grad.clone() for n, p in built.model.named_parameters()}


@pytest.mark.parametrize(
    "mode",
    ["default", "regional", pytest.param("max-autotune", marks=pytest.mark.slow)],  # ~40 s
)
def test_compiled_step_equals_eager(mode, tiny_cfg):
    """fp32, dropout off (inductor draws dropout masks from its own RNG stream); inductor
    reorders reductions, hence a tolerance rather than bit equality."""
    tiny_cfg.model.dropout = 0.0
    tiny_cfg.train.precision = "fp32"
    x = torch.randint(0, 256, (tiny_cfg.train.batch_size, 65))
    eager_loss, eager_grads = _loss_and_grads(tiny_cfg, x)
    tiny_cfg.train.compile = mode
    torch._dynamo.reset()
    loss, grads = _loss_and_grads(tiny_cfg, x)
    assert loss == pytest.approx(eager_loss, rel=1e-5)
    for name, g in grads.items():
        torch.testing.assert_close(g, eager_grads[name], rtol=1e-4, atol=1e-6, msg=name)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_max_autotune_on_a_gpu_accumulates_what_eager_does(tiny_cfg):
    """On a GPU max-autotune records CUDA graphs, whose outputs each replay overwrites: four
    micro-batches a step through the compiled loss (what `train.compile auto` may take for a
    long run), three steps on one model (warm-up, recording, replays), accumulate the same loss
    and gradients as eagerly."""
    tiny_cfg.model.dropout = 0.0
    tiny_cfg.train.precision, tiny_cfg.train.device = "fp32", "cuda"
    tiny_cfg.train.micro_batch_size = tiny_cfg.train.batch_size // 4
    x = torch.randint(0, 256, (tiny_cfg.train.batch_size, 65), device="cuda")
    eager_loss, eager_grads = _loss_and_grads(tiny_cfg, x)
    tiny_cfg.train.compile = "max-autotune"
    torch._dynamo.reset()
    built = build(tiny_cfg, with_data=False)
    for _ in range(3):
        built.model.zero_grad(set_to_none=True)
        loss = built.step.forward_backward(x[:, :-1], x[:, 1:], x[:, 1:].numel()).item()
        assert loss == pytest.approx(eager_loss, rel=1e-4)
        for name, p in built.model.named_parameters():
            torch.testing.assert_close(p.grad, eager_grads[name], rtol=1e-3, atol=1e-5, msg=name)


@pytest.mark.slow  # an autotuned compile: ~10 s
def test_max_autotune_keeps_its_table_of_choices_out_of_the_output(capfd, monkeypatch):
    """Inductor writes a table of the choices it timed for each product to stderr (a step has
    ~20): onegpu's max-autotune leaves them out. A bf16 batched product, where a CPU with bf16
    matmuls times oneDNN's kernel against inductor's C++ template (AMX's micro-GEMM here)."""
    from onegpu.techniques.compile import autotune_options

    # a graph from inductor's cache times nothing
    monkeypatch.setattr(torch.compiler.config, "force_disable_caches", True)
    a = torch.randn(8, 512, 64, dtype=torch.bfloat16)
    b = torch.randn(8, 64, 512, dtype=torch.bfloat16)
    torch._dynamo.reset()
    f = torch.compile(lambda a, b: torch.bmm(a, b).relu(), options=autotune_options())
    torch.testing.assert_close(f(a, b), torch.bmm(a, b).relu())
    assert "AUTOTUNE" not in capfd.readouterr().err


@pytest.mark.slow  # a compile: ~8 s
def test_compiled_gelu_is_gpt2s_tanh_gelu():
    """Compiled, TanhGELU computes x * sigmoid(2u) instead of 0.5 x (1 + tanh(u)): the same
    function to fp32 rounding, forward and backward, over the range activations take."""
    import torch.nn.functional as F

    from onegpu.models.gpt import TanhGELU

    x = torch.linspace(-12, 12, 20_001, dtype=torch.float64).float().requires_grad_()
    compiled = torch.compile(TanhGELU(), backend="inductor")
    y = compiled(x)
    ref = F.gelu(x, approximate="tanh")
    torch.testing.assert_close(y, ref, rtol=2e-6, atol=2e-6)
    (dy,) = torch.autograd.grad(y.sum(), x)
    (dref,) = torch.autograd.grad(ref.sum(), x)
    torch.testing.assert_close(dy, dref, rtol=2e-5, atol=2e-5)
    assert torch.equal(TanhGELU()(x), ref)  # eager: torch's own kernel


def test_two_compiles_for_the_same_device_get_equal_options(monkeypatch):
    """torch.compile's backend compares its options; dynamo compiles a function again for a
    backend it finds unequal. Each block's compile under `regional` asks for its own options,
    so they must compare equal. They hold the bias pass where oneDNN has bf16 matmuls: taken as
    present here, so that every CPU checks it."""
    from onegpu.techniques import bias_epilogue

    monkeypatch.setattr(bias_epilogue, "available", lambda: True)
    cpu = torch.device("cpu")
    first, second = bias_epilogue.inductor_options(cpu), bias_epilogue.inductor_options(cpu)
    assert first["post_grad_custom_post_pass"] is not second["post_grad_custom_post_pass"]
    assert first == second


@pytest.mark.slow  # compiles a model with inductor: ~15 s
def test_regional_compile_compiles_the_block_once_however_deep_the_model(monkeypatch):
    """Each block gets its own `torch.compile` over the same code. Dynamo reuses the first
    block's graph only where the backends compare equal (their options, the CPU bias pass
    among them); otherwise it compiles every block anew and, past its recompile limit, runs
    the rest eagerly. One more block than that limit: one graph, every block compiled. The
    options hold the pass on every CPU here (it changes nothing where oneDNN lacks bf16)."""
    from torch._dynamo.utils import counters

    from onegpu.models.gpt import GPT, ModelConfig
    from onegpu.techniques import compile as compile_
    from onegpu.techniques.bias_epilogue import BiasInEpilogue
    from onegpu.techniques.compile import apply_compile

    def options(device: torch.device) -> dict:  # a new pass for each block, as the run's
        return {"post_grad_custom_post_pass": BiasInEpilogue()}

    monkeypatch.setattr(compile_, "inductor_options", options)

    torch._dynamo.reset()
    counters.clear()
    depth = torch._dynamo.config.recompile_limit + 1
    cfg = ModelConfig(n_layer=depth, d_model=32, n_head=2, seq_len=16, vocab_size=64)
    model = GPT(cfg)
    try:
        apply_compile(model, None, "regional", torch.device("cpu"))
        x = torch.randint(0, 64, (2, 16))
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits = model(x)
        logits.float().sum().backward()
        assert counters["stats"]["unique_graphs"] == 1
        assert counters["frames"]["total"] == counters["frames"]["ok"] == 1
    finally:
        torch._dynamo.reset()  # no compiled blocks left behind for later tests
