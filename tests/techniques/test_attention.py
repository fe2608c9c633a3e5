import pytest
import torch

from onegpu.config import ConfigError
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
    from onegpu.techniques.attention import AttentionCall

    cpu = torch.device("cpu")
    tiny_cfg.model.attention = "auto"
    call = AttentionCall(batch=3, heads=2, seq_len=tiny_cfg.model.seq_len, head_dim=16)
    first = _chosen(attention, tiny_cfg.model, cpu, torch.bfloat16, call)
    assert first in attention.cpu_candidates(tiny_cfg.model)

    def no_measuring(*a, **k):
        raise AssertionError("measured again")

    monkeypatch.setattr(attention, "measure_cpu_attention", no_measuring)
    assert _chosen(attention, tiny_cfg.model, cpu, torch.bfloat16, call) == first
    assert _chosen(attention, tiny_cfg.model, torch.device("meta"), torch.float32, call) == "sdpa"
    tiny_cfg.model.softmax_dtype = "bfloat16"  # plain would no longer be exact: never chosen
    five = AttentionCall(batch=5, heads=2, seq_len=tiny_cfg.model.seq_len, head_dim=16)
    assert _chosen(attention, tiny_cfg.model, cpu, torch.bfloat16, five) == "sdpa"
    tiny_cfg.model.attention = "math"
    assert _chosen(attention, tiny_cfg.model, cpu, torch.bfloat16, call) == "math"


def test_a_plan_takes_what_a_run_chose_under_the_runs_allocator(tiny_cfg, monkeypatch, tmp_path):
    """`onegpu train` re-executes itself under tcmalloc or mimalloc; `onegpu plan` (and an
    in-process plan) runs under glibc. A plan first reads the choice a run made under the
    run's allocator, so it predicts the kernel the run uses; a run reads only its own."""
    from onegpu.techniques import attention
    from onegpu.techniques.attention import AttentionCall

    monkeypatch.setenv("ONEGPU_CACHE", str(tmp_path))
    monkeypatch.setattr(attention, "active_allocator", lambda: "system")
    monkeypatch.setattr(attention, "run_allocator", lambda: "mimalloc")
    timed = []
    monkeypatch.setattr(
        attention, "measure_cpu_attention", lambda *a, **k: timed.append(a) or _timed_as("sdpa")
    )
    tiny_cfg.model.attention = "auto"
    call = AttentionCall(batch=3, heads=2, seq_len=tiny_cfg.model.seq_len, head_dim=16)
    cpu = torch.device("cpu")
    assert _chosen(attention, tiny_cfg.model, cpu, torch.bfloat16, call) == "sdpa"
    assert len(timed) == 1  # a run under glibc timed under its own key
    monkeypatch.setattr(attention, "active_allocator", lambda: "mimalloc")  # a run of `train`
    monkeypatch.setattr(attention, "measure_cpu_attention", lambda *a, **k: _timed_as("plain"))
    assert _chosen(attention, tiny_cfg.model, cpu, torch.bfloat16, call) == "plain"
    monkeypatch.setattr(attention, "active_allocator", lambda: "system")  # a plan again
    monkeypatch.setattr(attention, "measure_cpu_attention", _refuse_timing)
    assert _chosen(attention, tiny_cfg.model, cpu, torch.bfloat16, call, timed=False) == "plain"
    assert _chosen(attention, tiny_cfg.model, cpu, torch.bfloat16, call) == "sdpa"


def _chosen(attention, *args, **kwargs) -> str:
    """The implementation attention_choice() picks (its timing left aside)."""
    return attention.attention_choice(*args, **kwargs)[0]


def _refuse_timing(*a, **k):
    raise AssertionError("timed although a run's choice was cached")


def _timed_as(name: str) -> dict:
    """What measure_cpu_attention returns where `name` won."""
    return {"choice": name, "ms": {"sdpa": 2.0, name: 1.0}}


def test_auto_times_the_call_each_process_makes(tiny_cfg, monkeypatch, tmp_path):
    """Timed at the rows' length (data.seq_len, not the model's), at each process's heads
    (1/tp), with packed documents' mask: each is a call of its own in the cache."""
    from onegpu.backends.torch.resolve import attention_call, resolve
    from onegpu.techniques import attention

    monkeypatch.setenv("ONEGPU_CACHE", str(tmp_path))  # nothing timed before this test
    timed = []

    def measure(call, dtype, candidates, compiled=False):
        timed.append(call)
        return _timed_as("sdpa")

    monkeypatch.setattr(attention, "measure_cpu_attention", measure)
    m = tiny_cfg.model
    m.attention, m.n_head, m.d_model, m.seq_len = "auto", 4, 64, 64
    tiny_cfg.data.seq_len, tiny_cfg.dist.tp = 32, 2
    call = attention_call(tiny_cfg, m)
    assert (call.batch, call.heads, call.seq_len, call.head_dim, call.documents) == (
        tiny_cfg.train.micro_batch_size,
        2,
        32,
        16,
        False,
    )
    tiny_cfg.dist.tp, tiny_cfg.data.packing = 1, "bfd"
    resolve(tiny_cfg, torch.device("cpu"))
    resolve(tiny_cfg, torch.device("cpu"))  # cached: timed once
    tiny_cfg.data.packing = "stream"
    resolve(tiny_cfg, torch.device("cpu"))
    assert [(c.heads, c.seq_len, c.documents) for c in timed] == [(4, 32, True), (4, 32, False)]


def test_packed_rows_are_timed_with_their_documents_mask(monkeypatch):
    """Every candidate runs on the block-diagonal mask (SDPA takes it instead of its causal
    path), and the mask keeps each query inside its own document."""
    from onegpu.techniques import attention
    from onegpu.techniques.attention import AttentionCall, measure_cpu_attention

    call = AttentionCall(batch=2, heads=2, seq_len=64, head_dim=16, documents=True)
    seen: dict[str, list] = {}
    for name, kernel in dict(attention._KERNELS).items():

        def recorded(q, k, v, mask, kernel=kernel, name=name):
            seen.setdefault(name, []).append(mask)
            return kernel(q, k, v, mask)

        monkeypatch.setitem(attention._KERNELS, name, recorded)
    candidates = ("sdpa", "plain", "blocked")
    found = measure_cpu_attention(call, torch.bfloat16, candidates)
    assert found["choice"] in candidates and set(found["ms"]) == set(candidates)
    assert set(seen) == set(candidates)
    for masks in seen.values():
        mask = masks[0]
        assert mask.shape == (2, 1, 64, 64) and all(m is mask for m in masks)
        assert mask[0, 0, 31].sum() == 32 and mask[0, 0, 32].sum() == 1  # a document at 32
        assert not mask[0, 0].triu(1).any()
    seen.clear()
    measure_cpu_attention(AttentionCall(2, 2, 64, 16), torch.bfloat16, candidates)
    assert all(m is None for masks in seen.values() for m in masks)  # one document: causal


def test_near_ties_go_to_the_kernel_that_saves_less():
    """Each kernel that keeps more for backward must beat the leaner choice by MIN_GAIN."""
    from onegpu.techniques.attention import pick

    assert pick({"sdpa": 1.0, "plain": 0.95, "blocked": 0.93}) == "sdpa"
    assert pick({"sdpa": 1.0, "plain": 0.80, "blocked": 0.85}) == "blocked"  # plain: 3x bytes
    assert pick({"sdpa": 1.0, "plain": 0.70, "blocked": 0.85}) == "plain"
    assert pick({"sdpa": 1.0, "plain": 0.85}) == "plain"
    # plain beats sdpa by 0.9 but not blocked, which keeps ~3x less than plain: blocked would
    # be no pick either (0.95 of sdpa), so sdpa stays
    assert pick({"sdpa": 1.0, "blocked": 0.95, "plain": 0.88}) == "sdpa"


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
        enabled, strategy, dp_size = True, "ddp", 2

        def on_main(self, fn):
            chosen = {"model.attention": "plain", "memory.loss_chunk": "32"}
            timings = {
                "loss_kernel_timing": {"skipped": "rank 0's reason"},
                "attention_timing": _timed_as("plain") | {"cached": False},
            }
            return chosen | {"train.loss_kernel": "eager"}, timings

    def no_measuring(*a, **k):
        raise AssertionError("timed on a process other than rank 0")

    monkeypatch.setattr(attention, "measure_cpu_attention", no_measuring)
    tiny_cfg.model.attention = "auto"
    resolved = resolve_agreed(tiny_cfg, torch.device("cpu"), None, NotRankZero(), timed=True)
    assert resolved.attention == resolved.config.model.attention == "plain"
    assert resolved.config.memory.loss_chunk == 32
    # the loss kernel's choice and rank 0's figures, for every process's first line
    assert resolved.config.train.loss_kernel == "eager"
    assert resolved.loss_kernel_timing == {"skipped": "rank 0's reason"}
    assert resolved.attention_timing == _timed_as("plain") | {"cached": False}


def test_the_first_line_gives_the_attention_timing(tiny_cfg, monkeypatch, tmp_path):
    """The candidates' times behind `auto`'s choice, then `cached` where a run read them."""
    from onegpu.backends.torch.build import build
    from onegpu.backends.torch.report import describe_auto
    from onegpu.perf import contention
    from onegpu.techniques import attention

    monkeypatch.setenv("ONEGPU_CACHE", str(tmp_path))
    monkeypatch.setattr(attention, "measure_cpu_attention", lambda *a, **k: _timed_as("plain"))
    tiny_cfg.model.attention = "auto"
    built = build(tiny_cfg, torch.device("cpu"), with_data=False)
    assert built.cfg.model.attention == "plain"
    timing = "a layer's forward + backward: sdpa 2.0 ms, plain 1.0 ms"
    assert f"attention plain ({timing})" in describe_auto(built)
    assert built.resolved.attention_timing == _timed_as("plain") | {"cached": False}
    monkeypatch.setattr(attention, "measure_cpu_attention", _refuse_timing)
    again = build(tiny_cfg, torch.device("cpu"), with_data=False)  # this process timed it
    assert f"attention plain ({timing})" in describe_auto(again)
    monkeypatch.setattr(contention, "_MEASURED", set())  # a later process reads it
    later = build(tiny_cfg, torch.device("cpu"), with_data=False)
    assert f"attention plain ({timing}, cached)" in describe_auto(later)
    tiny_cfg.model.attention = "sdpa"  # set by hand: nothing to say
    assert "attention" not in describe_auto(build(tiny_cfg, torch.device("cpu"), with_data=False))


def test_a_compiling_run_is_decided_by_the_kernels_compiled(tiny_cfg, monkeypatch, tmp_path):
    """Inductor fuses the matmul attentions' softmax, never SDPA's kernel: a run that
    compiles its blocks times the candidates compiled, cached apart from the eager timing; a
    run that does not, eagerly."""
    from onegpu.backends.torch.resolve import resolve
    from onegpu.techniques import attention

    monkeypatch.setenv("ONEGPU_CACHE", str(tmp_path))
    timed = []

    def measure(call, dtype, candidates, compiled=False):
        timed.append(compiled)
        return _timed_as("plain" if compiled else "sdpa") | ({"compiled": True} if compiled else {})

    monkeypatch.setattr(attention, "measure_cpu_attention", measure)
    tiny_cfg.model.attention = "auto"
    tiny_cfg.train.compile = "regional"
    regional = resolve(tiny_cfg, torch.device("cpu"))
    assert regional.config.model.attention == "plain"
    assert regional.attention_if_eager is None  # set to compile: never eager
    tiny_cfg.train.compile = "none"
    assert resolve(tiny_cfg, torch.device("cpu")).config.model.attention == "sdpa"
    tiny_cfg.train.compile = "default"
    assert resolve(tiny_cfg, torch.device("cpu")).config.model.attention == "plain"  # cached
    assert timed == [True, False]


def test_compile_auto_staying_eager_takes_the_leaner_eager_choice(tiny_cfg, monkeypatch, tmp_path):
    """`train.compile auto` on a run long enough to compile picks attention by the compiled
    timing (what the plan follows); if the compile trial then keeps the run eager, the run
    takes the kernel eager timings pick where it keeps less, and says so in its config."""
    from onegpu.backends.torch.build import build
    from onegpu.models.gpt import Attention
    from onegpu.techniques import attention, compile_auto

    monkeypatch.setenv("ONEGPU_CACHE", str(tmp_path))

    def measure(call, dtype, candidates, compiled=False):
        return _timed_as("plain" if compiled else "sdpa") | ({"compiled": True} if compiled else {})

    monkeypatch.setattr(attention, "measure_cpu_attention", measure)
    stays_eager = compile_auto.CompileTrial(1.0, 1.0, 30.0, mode="default")
    seen = []

    def decide(cfg, model, eager, candidates, autocast, device):
        """The trial's eager step runs the eager pick, each mode its compiled pick."""

        def impls():
            return {m.impl for m in model.modules() if isinstance(m, Attention)}

        seen.append(impls())
        candidates["regional"].enter()
        seen.append(impls())
        candidates["regional"].leave()
        seen.append(impls())
        return "none", stays_eager

    monkeypatch.setattr(compile_auto, "decide", decide)
    tiny_cfg.model.attention, tiny_cfg.train.compile = "auto", "auto"
    tiny_cfg.train.max_steps, tiny_cfg.train.gelu_kernel = 500, "eager"
    built = build(tiny_cfg, torch.device("cpu"), with_data=False)
    assert built.resolved.attention_if_eager == "sdpa"
    assert built.cfg.train.compile == "none"
    assert built.cfg.model.attention == "sdpa"
    from onegpu.backends.torch.report import describe_auto

    assert (
        "attention sdpa (a layer's forward + backward compiled: sdpa 2.0 ms, plain 1.0 ms; "
        "the run stays eager: sdpa, which keeps less)"
    ) in describe_auto(built)
    impls = {m.impl for m in built.model.modules() if isinstance(m, Attention)}
    assert impls == {"sdpa"}
    assert seen == [{"sdpa"}, {"plain"}, {"sdpa"}]
    monkeypatch.setattr(compile_auto, "decide", lambda *a, **k: ("default", stays_eager))
    compiled = build(tiny_cfg, torch.device("cpu"), with_data=False)
    assert compiled.cfg.model.attention == "plain"
    assert {m.impl for m in compiled.model.modules() if isinstance(m, Attention)} == {"plain"}


@pytest.mark.slow
def test_the_compiled_timing_runs_each_candidate_compiled():
    from onegpu.techniques.attention import AttentionCall, measure_cpu_attention

    call = AttentionCall(batch=2, heads=2, seq_len=32, head_dim=16)
    found = measure_cpu_attention(call, torch.float32, ("sdpa", "plain"), compiled=True)
    assert found["compiled"] is True and found["choice"] in ("sdpa", "plain")
    assert set(found["ms"]) == {"sdpa", "plain"} and all(t > 0 for t in found["ms"].values())


@pytest.mark.parametrize(
    "checkpointing, recomputes",
    [("block", True), ("attn", True), ("every:2", True), ("blocks:none,attn+mlp", True),
     ("budget:auto", True), ("mlp", False), ("selective", False), ("none", False),
     ("blocks:mlp,selective", False), ("budget-compiled:0.5", False)],
)  # fmt: skip
def test_which_checkpointing_runs_attention_again_in_backward(checkpointing, recomputes):
    from onegpu.config import parse_checkpointing

    assert parse_checkpointing(checkpointing).recomputes_attention() is recomputes


def test_sdpa_is_left_out_where_compiled_tensor_parallel_recompute_breaks_it(
    tiny_cfg, monkeypatch, tmp_path
):
    """torch (2.13) cannot recompute SDPA's fused CPU kernel in a compiled checkpoint whose
    graph holds a DTensor's mesh: with tensor parallelism, compiled blocks and checkpointing
    that recomputes attention, `auto` times the other kernels only and a setting that asks for
    the fused kernel is refused with the ways out; change any one of the three and SDPA is
    back (tests/distributed/test_parallel_layouts.py runs the combination)."""
    from onegpu.backends.torch.resolve import resolve
    from onegpu.techniques import attention

    monkeypatch.setenv("ONEGPU_CACHE", str(tmp_path))
    offered = []

    def measure(call, dtype, candidates, compiled=False):
        offered.append(candidates)
        return {"choice": candidates[0], "ms": {name: 1.0 for name in candidates}}

    monkeypatch.setattr(attention, "measure_cpu_attention", measure)
    cfg = tiny_cfg
    cfg.model.attention, cfg.train.precision = "auto", "fp32"  # fp32: no matmuls to time
    cfg.dist.tp, cfg.train.compile, cfg.memory.checkpointing = 2, "regional", "block"
    cpu = torch.device("cpu")
    assert resolve(cfg, cpu).attention in ("plain", "blocked")
    assert "sdpa" not in offered[-1]
    for name in ("sdpa", "flash"):
        cfg.model.attention = name
        with pytest.raises(ConfigError, match=r"model\.attention.*memory\.checkpointing mlp"):
            resolve(cfg, cpu)
    for name in ("math", "plain", "blocked"):
        cfg.model.attention = name
        assert resolve(cfg, cpu).attention == name
    cfg.model.attention = "auto"
    cfg.model.dropout = 0.1  # SDPA then takes its math path on a CPU: offered, and it runs
    resolve(cfg, cpu)
    assert "sdpa" in offered[-1]
    cfg.model.attention, cfg.model.dropout = "sdpa", 0.0
    # `auto` compile under torchrun stays eager, also where nothing says how many processes
    # (the start-up check resolves without them)
    cfg.train.compile, cfg.train.max_steps = "auto", 10_000
    cfg.train.loss_kernel = cfg.train.gelu_kernel = "eager"  # nothing else to time here
    assert resolve(cfg, cpu).attention == "sdpa"
    cfg.train.compile = "regional"
    for field, value in (
        ("dist.tp", 1),
        ("train.compile", "none"),
        ("memory.checkpointing", "mlp"),
    ):
        section, key = field.split(".")
        previous = getattr(getattr(cfg, section), key)
        setattr(getattr(cfg, section), key, value)
        assert resolve(cfg, cpu).attention == "sdpa", field
        setattr(getattr(cfg, section), key, previous)
