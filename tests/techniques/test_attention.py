import torch

from onegpu.models.gpt import GPT


def _pair(tiny_cfg):
    tiny_cfg.model.attention = "sdpa"
    sdpa = GPT(tiny_cfg.model)
    sdpa.init_weights()
    tiny_cfg.model.attention = "plain"
    plain = GPT(tiny_cfg.model)
    plain.load_state_dict(sdpa.state_dict())
    return sdpa, plain


def test_sdpa_equals_plain_fp32_softmax_attention(tiny_cfg):
    sdpa, plain = _pair(tiny_cfg)
    idx = torch.randint(0, 256, (3, tiny_cfg.model.seq_len))
    out_s, out_p = sdpa(idx), plain(idx)
    torch.testing.assert_close(out_s, out_p, rtol=1e-5, atol=1e-5)
    out_s.square().mean().backward()
    out_p.square().mean().backward()
    for (name, a), b in zip(sdpa.named_parameters(), plain.parameters(), strict=True):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-5, atol=1e-6, msg=name)


def test_plain_attention_keeps_fp32_softmax_under_autocast(tiny_cfg):
    from onegpu.models import gpt

    seen = []
    orig = torch.Tensor.softmax

    def spy(self, *a, **k):
        seen.append(self.dtype)
        return orig(self, *a, **k)

    tiny_cfg.model.attention = "plain"
    model = GPT(tiny_cfg.model)
    model.init_weights()
    idx = torch.randint(0, 256, (2, 16))
    torch.Tensor.softmax = spy
    try:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            model(idx)
    finally:
        torch.Tensor.softmax = orig
    assert seen and all(d == torch.float32 for d in seen)
    assert gpt._DTYPES["float32"] is torch.float32


def test_causal_no_information_from_the_future(tiny_cfg):
    """The output at position t has zero gradient with respect to inputs after t (nanodo)."""
    for impl in ("sdpa", "plain", "blocked"):
        tiny_cfg.model.attention = impl
        model = GPT(tiny_cfg.model)
        model.init_weights()
        x = model.wte(torch.randint(0, 256, (1, 16))).detach().requires_grad_(True)
        h = x + model.wpe(torch.arange(16))
        for block in model.blocks:
            h = block(h)
        h[0, 7].sum().backward()
        assert torch.all(x.grad[0, 8:] == 0), impl
        assert torch.any(x.grad[0, :8] != 0), impl


def test_each_available_sdpa_backend_equals_the_plain_reference(tiny_cfg):
    """flash, math and blocked run on a CPU and give the reference's outputs and gradients;
    efficient has no CPU kernel and is refused before anything runs (exit 2 in the CLI)."""
    import pytest

    from onegpu.config import ConfigError
    from onegpu.techniques.attention import check_attention_backend

    _, plain = _pair(tiny_cfg)
    idx = torch.randint(0, 256, (2, tiny_cfg.model.seq_len))
    ref = plain(idx)
    ref.square().mean().backward()
    for impl in ("flash", "math", "blocked"):
        check_attention_backend(impl, torch.device("cpu"), torch.float32)
        tiny_cfg.model.attention = impl
        model = GPT(tiny_cfg.model)
        model.load_state_dict(plain.state_dict())
        out = model(idx)
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
        out.square().mean().backward()
        for a, b in zip(model.parameters(), plain.parameters(), strict=True):
            torch.testing.assert_close(a.grad, b.grad, rtol=1e-5, atol=1e-6)
    with pytest.raises(ConfigError, match="model.attention"):
        check_attention_backend("efficient", torch.device("cpu"), torch.float32)


def test_auto_attention_is_measured_once_then_cached(tiny_cfg, monkeypatch):
    from onegpu.techniques import attention

    cpu = torch.device("cpu")
    tiny_cfg.model.attention = "auto"
    first = attention.resolve_attention(tiny_cfg.model, cpu, torch.bfloat16, batch=3)
    assert first in attention.cpu_candidates(tiny_cfg.model)

    def no_measuring(*a):
        raise AssertionError("measured again")

    monkeypatch.setattr(attention, "measure_cpu_attention", no_measuring)
    assert attention.resolve_attention(tiny_cfg.model, cpu, torch.bfloat16, batch=3) == first
    assert (
        attention.resolve_attention(tiny_cfg.model, torch.device("meta"), torch.float32, 3)
        == "sdpa"
    )
    tiny_cfg.model.softmax_dtype = "bfloat16"  # plain would no longer be exact: never chosen
    assert attention.resolve_attention(tiny_cfg.model, cpu, torch.bfloat16, batch=5) == "sdpa"
    tiny_cfg.model.attention = "math"
    assert attention.resolve_attention(tiny_cfg.model, cpu, torch.bfloat16, batch=3) == "math"


def test_auto_weighs_blocked_only_where_its_probabilities_are_small(tiny_cfg):
    """blocked saves T^2/2 values a head: a candidate at seq 256 (model B's shape), not at
    seq 2048 with 4 heads of 64 (its probabilities would double the block's activations),
    never with dropout (it takes none)."""
    from onegpu.techniques.attention import cpu_candidates

    m = tiny_cfg.model
    m.dropout, m.n_head, m.d_model, m.seq_len = 0.0, 6, 384, 256
    assert cpu_candidates(m) == ("sdpa", "plain", "blocked")
    m.n_head, m.d_model, m.seq_len = 4, 256, 2048
    assert "blocked" not in cpu_candidates(m)
    m.seq_len, m.dropout = 256, 0.1
    assert "blocked" not in cpu_candidates(m)
    m.dropout = 0.0
    assert "blocked" not in cpu_candidates(m, torch.float16)  # fp16 backward products
    # selective checkpointing would keep its fp32 scores (matmul outputs)
    assert "blocked" not in cpu_candidates(m, keeps_products=True)


def test_processes_take_rank_zeros_timed_choices(tiny_cfg, monkeypatch):
    """Under torchrun every process runs the kernel rank 0 timed: processes timing at once on a
    shared machine could disagree, and a tensor-parallel layer must run one kernel everywhere.
    Here rank 0 chose plain and a chunk of 32; this process times nothing and takes both."""
    from onegpu.backends.torch.resolve import resolve_agreed
    from onegpu.techniques import attention

    class NotRankZero:
        enabled = True

        def on_main(self, fn):
            return {"model.attention": "plain", "memory.loss_chunk": "32"}

    def no_measuring(*a):
        raise AssertionError("timed on a process other than rank 0")

    monkeypatch.setattr(attention, "measure_cpu_attention", no_measuring)
    tiny_cfg.model.attention = "auto"
    resolved = resolve_agreed(tiny_cfg, torch.device("cpu"), None, NotRankZero(), timed=True)
    assert resolved.attention == resolved.config.model.attention == "plain"
    assert resolved.config.memory.loss_chunk == 32
