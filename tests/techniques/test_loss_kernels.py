"""`train.loss_kernel`: the chunked loss's compiled per-chunk kernels compute what ATen's do
(same loss and gradients, fp32 rounding apart), are used only where they apply, and `auto`
compiles only where a timing says the run wins the compile back."""

import dataclasses
import json

import pytest
import torch

from onegpu.backends.torch.build import build
from onegpu.backends.torch.step_memory import measure_real_step
from onegpu.cache import cache_root
from onegpu.config import ConfigError, load_config
from onegpu.perf import contention
from onegpu.plan.memory import plan_memory
from onegpu.techniques import loss_kernel_auto, loss_kernel_cpu, loss_kernels
from onegpu.techniques.chunked_loss import ChunkedLinearCrossEntropy
from onegpu.techniques.kernel_trial import choose
from onegpu.techniques.loss_kernel_auto import LossShape, resolve_loss_kernel
from onegpu.techniques.loss_kernels import LossKernels, compiled_kernels

CPU = torch.device("cpu")
IGNORE = -100


def _inputs(param_dtype: torch.dtype, bias: bool = False, device: torch.device = CPU):
    """100 tokens (chunks of 32: the last one 4), a vocabulary of 120 padded to 128, every
    seventh target ignored."""
    g = torch.Generator().manual_seed(0)

    def leaf(x: torch.Tensor) -> torch.Tensor:
        return x.to(device, param_dtype).requires_grad_()

    h = leaf(torch.randn(100, 24, generator=g))
    w = leaf(torch.randn(128, 24, generator=g) * 0.5)
    b = leaf(torch.randn(128, generator=g) * 0.1) if bias else None
    t = torch.randint(0, 120, (100,), generator=g)
    t[::7] = IGNORE
    return h, w, b, t.to(device)


def _loss_and_grads(kernels, param_dtype, compute_dtype, bias=False, device=CPU):
    h, w, b, t = _inputs(param_dtype, bias, device)
    loss = ChunkedLinearCrossEntropy.apply(h, w, b, t, 32, compute_dtype, 120, None, kernels)
    loss.backward()
    grads = [h.grad, w.grad] + ([b.grad] if bias else [])
    return loss.detach(), grads


@pytest.mark.parametrize(
    ("param_dtype", "compute_dtype", "rtol", "sums"),
    [
        (torch.float32, torch.float32, 1e-5, 0),  # fp32: the padding masked in every pass
        (torch.float32, torch.bfloat16, 1e-2, 4),  # bf16 autocast: fp32 weights, bf16 matmuls
        (torch.bfloat16, torch.bfloat16, 1e-2, 0),  # bf16-pure: bf16 weights and gradients
    ],
)
def test_compiled_kernels_compute_what_aten_computes(
    param_dtype, compute_dtype, rtol, sums, monkeypatch
):
    """Loss and gradients through the compiled kernels equal ATen's, with a shorter last chunk,
    vocabulary padding and ignored tokens; and the compiled kernels did run: on a CPU the C++
    kernel for every chunk's softmax gradient, inductor's for the weight gradient's sum. The
    loss is fp32 math on the same logits: equal to 1e-5 in every precision; 16-bit gradients
    may round a value the other way."""
    compiled, calls = compiled_kernels(), []

    def counted(fn):
        return lambda *a: calls.append(fn) or fn(*a)

    cpp = loss_kernel_cpu.softmax_grad
    monkeypatch.setattr(loss_kernel_cpu, "softmax_grad", counted(cpp))
    kernels = LossKernels(counted(compiled.softmax_grad), counted(compiled.add_product))
    loss_c, grads_c = _loss_and_grads(kernels, param_dtype, compute_dtype)
    assert calls.count(compiled.softmax_grad) == 4  # chunks of 32, 32, 32, 4
    assert calls.count(cpp) == 4
    # fp32 gradients of 16-bit products: summed by the compiled kernel, once a chunk (the
    # others add the product in the matmul's dtype, by addmm_)
    assert calls.count(compiled.add_product) == sums
    assert hasattr(compiled.add_product, "_torchdynamo_orig_callable")  # torch.compile's
    loss_e, grads_e = _loss_and_grads(None, param_dtype, compute_dtype)
    torch.testing.assert_close(loss_c, loss_e, rtol=1e-5, atol=1e-5)
    for c, e in zip(grads_c, grads_e, strict=True):
        assert c.dtype == e.dtype == param_dtype
        torch.testing.assert_close(c.float(), e.float(), rtol=rtol, atol=rtol * e.abs().max())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_the_cpu_kernels_op_passes_torchs_checks(dtype):
    """`onegpu::chunk_softmax_grad` as torch.library.opcheck sees it: its schema, its fake
    kernel's shapes and dtypes against the real one, and its calls under AOT dispatch."""
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(8, 70, generator=g).to(dtype)
    safe_t = torch.randint(0, 64, (8, 1), generator=g)
    valid = torch.rand(8, 1, generator=g) > 0.2
    torch.library.opcheck(loss_kernels.chunk_softmax_grad_op, (logits, safe_t, valid, 64, dtype))


def test_a_graph_compiled_around_the_loss_calls_the_cpu_kernel_without_a_break(monkeypatch):
    """`train.compile default` (or max-autotune) compiles the chunked loss into its graph: the
    C++ kernel is an op of its own there (`onegpu::chunk_softmax_grad`), which dynamo calls as
    it is. Dynamo cannot trace the extension's own call: it broke the graph around it, which
    `fullgraph=True` turns into an error. The same loss and gradients as eagerly."""
    calls = []
    cpp = loss_kernel_cpu.softmax_grad
    monkeypatch.setattr(loss_kernel_cpu, "softmax_grad", lambda *a: calls.append(1) or cpp(*a))
    kernels = compiled_kernels()

    def loss_of(h, w, t):
        return ChunkedLinearCrossEntropy.apply(
            h, w, None, t, 32, torch.bfloat16, 120, None, kernels
        )

    torch._dynamo.reset()
    whole = torch.compile(loss_of, fullgraph=True)
    h, w, _, t = _inputs(torch.float32)
    loss = whole(h, w, t)
    loss.backward()
    assert len(calls) == 4  # every chunk's softmax gradient by the C++ kernel
    h_e, w_e, _, _ = _inputs(torch.float32)
    loss_e = loss_of(h_e, w_e, t)
    loss_e.backward()
    torch.testing.assert_close(loss, loss_e, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(w.grad, w_e.grad, rtol=1e-2, atol=1e-2 * w_e.grad.abs().max())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("width, n_valid", [(1000, 1000), (1027, 1003)], ids=["", "padded"])
def test_the_cpu_kernel_computes_the_kernels_math(dtype, width, n_valid):
    """The C++ kernel against the math inductor compiles (`softmax_grad`, run eagerly here),
    rows of several widths around its vector step (a tail of each), ignored tokens, logits up
    to 60 apart: the same loss to fp32 rounding, the same gradient to one rounding of its
    dtype, padding columns exactly 0. (Also checked by hand at torch's AVX2 and default
    dispatch levels: ATEN_CPU_CAPABILITY=avx2|default.)"""
    g = torch.Generator().manual_seed(0)
    logits = (torch.randn(37, width, generator=g) * 20).to(dtype)
    safe_t = torch.randint(0, n_valid, (37, 1), generator=g)
    valid = torch.rand(37, 1, generator=g) > 0.2
    assert loss_kernel_cpu.applies(logits, dtype)
    loss_i, grad_i = loss_kernels.softmax_grad(logits, safe_t, valid, n_valid, dtype)
    loss_c, grad_c = loss_kernel_cpu.softmax_grad(logits, safe_t, valid, n_valid, dtype)
    assert grad_c.dtype == dtype and grad_c.shape == logits.shape
    torch.testing.assert_close(loss_c, loss_i, rtol=1e-6, atol=0)
    ulp = torch.finfo(dtype).eps
    assert (grad_c.float() - grad_i.float()).abs().max() <= ulp * grad_i.float().abs().max()
    assert not grad_c[:, n_valid:].any()
    rows = grad_c.float().sum(dim=1)  # softmax - onehot sums to 0, or to 1 where ignored
    torch.testing.assert_close(rows, (~valid.squeeze(1)).float(), atol=2e-2, rtol=0)


def test_where_the_cpu_kernel_does_not_build_inductors_computes_the_chunks(monkeypatch):
    """A build that fails (a compiler without Python's headers, say) is said once, and
    inductor's kernel computes the chunk, the same loss."""

    def no_build():
        raise OSError("Python.h: No such file or directory")

    monkeypatch.setattr(loss_kernel_cpu, "extension", no_build)
    loss_kernel_cpu.built.cache_clear()
    try:
        logits = torch.randn(8, 64).to(torch.bfloat16)
        safe_t, valid = torch.randint(0, 64, (8, 1)), torch.ones(8, 1, dtype=torch.bool)
        with pytest.warns(UserWarning, match="did not build.*Python.h"):
            assert not loss_kernel_cpu.applies(logits, torch.bfloat16)
        assert loss_kernel_cpu.suits(logits, torch.bfloat16)  # a plan still follows its bytes
        loss, _ = compiled_kernels().softmax_grad(logits, safe_t, valid, 64, torch.bfloat16)
        want, _ = loss_kernels.softmax_grad(logits, safe_t, valid, 64, torch.bfloat16)
        torch.testing.assert_close(loss, want, rtol=1e-5, atol=0)
    finally:
        loss_kernel_cpu.built.cache_clear()


@pytest.mark.gpu
def test_compiled_kernels_on_a_gpu_compute_what_aten_computes():
    """The same kernels built by inductor as Triton kernels: loss and gradients equal ATen's
    on the GPU (bf16 autocast: fp32 weights, bf16 matmuls)."""
    cuda = torch.device("cuda")
    loss_c, grads_c = _loss_and_grads(
        compiled_kernels(), torch.float32, torch.bfloat16, device=cuda
    )
    loss_e, grads_e = _loss_and_grads(None, torch.float32, torch.bfloat16, device=cuda)
    torch.testing.assert_close(loss_c, loss_e, rtol=1e-5, atol=1e-5)
    for c, e in zip(grads_c, grads_e, strict=True):
        torch.testing.assert_close(c, e, rtol=1e-2, atol=1e-2 * e.abs().max())


def _refuse(*_a, **_k):
    raise AssertionError("a compiled kernel ran where it does not apply")


def test_a_head_with_a_bias_runs_atens_softmax():
    """The fused kernel takes no bias: a biased head computes each chunk with ATen's softmax
    (the kernel given here would fail the test if called), and the bias gets its gradient; the
    weight gradient's sum still goes through the kernels given."""
    from onegpu.techniques.loss_kernels import add_product

    added = []
    kernels = LossKernels(
        softmax_grad=_refuse, add_product=lambda *a: added.append(1) or add_product(*a)
    )
    loss_k, grads_k = _loss_and_grads(kernels, torch.float32, torch.bfloat16, bias=True)
    loss_e, grads_e = _loss_and_grads(None, torch.float32, torch.bfloat16, bias=True)
    assert len(added) == 4 and grads_k[2].abs().sum() > 0
    assert torch.equal(loss_k, loss_e)
    assert all(torch.equal(k, e) for k, e in zip(grads_k, grads_e, strict=True))


# ---------------------------------------------------------------------------- auto


def _shape(chunk: int = 1024) -> LossShape:
    return LossShape(4096, 256, 50304, 50257, chunk, torch.bfloat16, torch.float32)


@pytest.mark.parametrize(
    ("timing", "micro_steps", "want"),
    [
        ({"eager_s": 1.0, "compiled_s": 0.9, "compile_s": 5.0}, 200, "compiled"),  # saves 15 s
        ({"eager_s": 1.0, "compiled_s": 0.9, "compile_s": 5.0}, 40, "eager"),  # saves -1 s
        ({"eager_s": 1.0, "compiled_s": 0.99, "compile_s": 0.0}, 10**6, "eager"),  # < MIN_GAIN
        ({"eager_s": 1.0, "compiled_s": 1.1, "compile_s": 0.0}, 10**6, "eager"),  # slower
        ({"failed": "CppCompileError: no compiler"}, 10**6, "eager"),
    ],
)
def test_compiled_only_where_the_run_wins_the_compile_back(timing, micro_steps, want):
    assert choose(timing, micro_steps) == want


def test_short_runs_unchunked_losses_and_split_vocabularies_are_never_timed(monkeypatch):
    monkeypatch.setattr(loss_kernel_auto, "measure_loss_kernel", _refuse)
    assert resolve_loss_kernel("auto", _shape(), CPU, 99) == (
        "eager",
        {"skipped": "a run of 99 micro-batches, under 100"},
    )
    assert resolve_loss_kernel("auto", _shape(chunk=0), CPU, 10**4) == ("eager", None)
    kernel, why = resolve_loss_kernel("auto", _shape(), CPU, 10**4, fusable=False)
    assert kernel == "eager" and "split over processes" in why["skipped"]
    assert resolve_loss_kernel("compiled", _shape(), CPU, 1) == ("compiled", None)


def test_without_a_compiler_auto_stays_eager_and_compiled_is_refused(monkeypatch, tmp_path):
    monkeypatch.setenv("ONEGPU_CACHE", str(tmp_path))
    monkeypatch.setattr(loss_kernel_auto, "missing_compiler", lambda device: "no C++ compiler")
    monkeypatch.setattr(loss_kernel_auto, "measure_loss_kernel", _refuse)
    assert resolve_loss_kernel("auto", _shape(), CPU, 10**4) == (
        "eager",
        {"skipped": "no C++ compiler"},
    )
    with pytest.raises(ConfigError, match="train.loss_kernel: compiled needs inductor"):
        resolve_loss_kernel("compiled", _shape(), CPU, 10**4)
    # a plan for another machine is not refused for what this one lacks
    assert resolve_loss_kernel("compiled", _shape(), CPU, 10**4, timed=False)[0] == "compiled"


def test_auto_times_once_per_shape_then_reads_the_cache(monkeypatch, tmp_path):
    monkeypatch.setenv("ONEGPU_CACHE", str(tmp_path))
    timing = {"eager_s": 1.0, "compiled_s": 0.8, "compile_s": 5.0}
    calls = []
    monkeypatch.setattr(
        loss_kernel_auto, "measure_loss_kernel", lambda *a: calls.append(a) or dict(timing)
    )
    assert resolve_loss_kernel("auto", _shape(), CPU, 1000) == (
        "compiled",
        timing | {"cached": False},
    )
    # read back in the process that timed it: paid here, not "cached" to its user
    assert resolve_loss_kernel("auto", _shape(), CPU, 1000)[1]["cached"] is False
    monkeypatch.setattr(contention, "_MEASURED", set())  # a later process
    assert resolve_loss_kernel("auto", _shape(), CPU, 1000) == (
        "compiled",
        timing | {"cached": True},
    )
    assert resolve_loss_kernel("auto", _shape(), CPU, 20)[0] == "eager"  # short: untimed
    assert len(calls) == 1
    # a plan reads what a run cached, and never times a shape nobody ran
    assert resolve_loss_kernel("auto", _shape(), CPU, 1000, timed=False)[0] == "compiled"
    kernel, why = resolve_loss_kernel("auto", _shape(2048), CPU, 1000, timed=False)
    assert kernel == "eager" and "a plan times nothing" in why["skipped"]
    assert len(calls) == 1
    stored = json.loads((tmp_path / "loss_kernel.json").read_text())
    assert list(stored.values()) == [timing]
    assert "|valid=50257|" in next(iter(stored))  # the padding is part of the shape


def test_measure_times_both_kernels_on_the_shape():
    """The real timing, at a small shape: both kernels ran and the compiled one's first call
    (its compile) is counted apart."""
    shape = LossShape(64, 16, 96, 90, 32, torch.bfloat16, torch.float32)
    found = loss_kernel_auto.measure_loss_kernel(shape, CPU)
    assert found["eager_s"] > 0 and found["compiled_s"] > 0 and found["compile_s"] >= 0


def _cfg(**over):
    base = {"train.device": "cpu", "train.precision": "fp32", "model.dropout": "0.0",
            "out.progress": "false", "memory.loss_chunk": "64"}  # fmt: skip
    return load_config("tiny", overrides=base | {k: str(v) for k, v in over.items()})


def test_a_run_follows_the_cached_timing_and_says_so(monkeypatch, tmp_path):
    """A long run takes the cached choice: its loss function runs the compiled kernels, its
    config.toml says compiled, the first line and summary.json give the timing."""
    monkeypatch.setenv("ONEGPU_CACHE", str(tmp_path))
    timing = {"eager_s": 0.5, "compiled_s": 0.25, "compile_s": 3.0}
    monkeypatch.setattr(loss_kernel_auto, "measure_loss_kernel", lambda *a: dict(timing))
    monkeypatch.setattr(loss_kernels, "compiled_kernels", lambda: LossKernels(_refuse, _refuse))
    built = build(_cfg(**{"train.max_steps": "300", "train.compile": "none"}), CPU, with_data=False)
    assert built.cfg.train.loss_kernel == "compiled"
    with pytest.raises(AssertionError, match="compiled kernel ran"):  # the kernels are the run's
        x = torch.zeros(1, 16, dtype=torch.long)
        built.loss_fn(built.model, x, x)
    from onegpu.backends.torch.report import describe_auto, kernel_record

    line = describe_auto(built)
    assert (
        "loss kernel compiled (a micro-batch's loss: eager 500 ms, compiled 250 ms, "
        "+3.0 s to compile)" in line
    )
    assert kernel_record(
        built.resolved.loss_kernel_timing, built.cfg.train.loss_kernel
    ) == timing | {"cached": False, "chosen": "compiled"}
    assert (cache_root() / "loss_kernel.json").exists()


def test_a_short_run_says_why_its_chunked_loss_was_not_timed(monkeypatch, tmp_path):
    monkeypatch.setenv("ONEGPU_CACHE", str(tmp_path))
    monkeypatch.setattr(loss_kernel_auto, "measure_loss_kernel", _refuse)
    built = build(_cfg(**{"train.max_steps": "10", "train.compile": "none"}), CPU, with_data=False)
    from onegpu.backends.torch.report import describe_auto

    assert built.cfg.train.loss_kernel == "eager"
    line = describe_auto(built)
    n = 10 * built.cfg.grad_accum_steps
    assert f"loss kernel eager (not timed: a run of {n} micro-batches, under 100)" in line


def test_each_data_parallel_process_weighs_the_micro_batches_it_runs(monkeypatch, tmp_path):
    """Under data parallelism every process compiles the kernels once and runs 1/dp of the
    run's micro-batches: the compile must pay for itself over those."""
    from onegpu.backends.torch.resolve import resolve

    monkeypatch.setenv("ONEGPU_CACHE", str(tmp_path))
    timing = {"eager_s": 0.5, "compiled_s": 0.25, "compile_s": 3.0}
    monkeypatch.setattr(loss_kernel_auto, "measure_loss_kernel", lambda *a: dict(timing))
    cfg = _cfg(**{"train.max_steps": "60", "train.batch_size": "8", "train.micro_batch_size": "4"})
    assert cfg.train.max_steps * cfg.grad_accum_steps == 120
    alone = resolve(cfg, CPU)
    assert alone.config.train.loss_kernel == "compiled"
    shared = resolve(cfg, CPU, ctx=_Processes("ddp", dp_size=2))
    assert shared.config.train.loss_kernel == "eager"
    assert shared.loss_kernel_timing == {"skipped": "a run of 60 micro-batches, under 100"}


class _Processes:
    """The parts of a DistContext the resolver reads."""

    enabled = True

    def __init__(self, strategy: str, dp_size: int):
        self.strategy, self.dp_size = strategy, dp_size


@pytest.mark.parametrize(
    ("strategy", "precision", "weights"),
    [
        ("none", "bf16", torch.float32),  # autocast casts each chunk from the fp32 weight
        ("ddp", "bf16", torch.float32),
        ("fsdp", "bf16", torch.bfloat16),  # FSDP gathers the weights cast to bf16
        ("fsdp", "fp32", torch.float32),
        ("fsdp", "bf16-pure", torch.bfloat16),
    ],
)
def test_the_timed_shape_has_the_weights_the_loss_receives(
    monkeypatch, tmp_path, strategy, precision, weights
):
    from onegpu.backends.torch.resolve import resolve

    monkeypatch.setenv("ONEGPU_CACHE", str(tmp_path))
    shapes: list[LossShape] = []

    def measure(shape, device):
        shapes.append(shape)
        return {"eager_s": 0.5, "compiled_s": 0.25, "compile_s": 3.0}

    monkeypatch.setattr(loss_kernel_auto, "measure_loss_kernel", measure)
    cfg = _cfg(**{"train.max_steps": "400", "train.precision": precision})
    resolve(cfg, CPU, ctx=_Processes(strategy, dp_size=1 if strategy == "none" else 2))
    assert [s.param_dtype for s in shapes] == [weights]


def test_a_hugging_face_head_with_a_bias_keeps_atens_kernels(monkeypatch, tmp_path, hf_folder):
    """Phi's output layer has a bias, which the fused kernels do not take: `auto` does not
    time them and says why, `compiled` runs ATen's with a warning; Llama's head has none."""
    from conftest import hf_overrides

    from onegpu.backends.torch.resolve import resolve

    monkeypatch.setenv("ONEGPU_CACHE", str(tmp_path))
    timing = {"eager_s": 0.5, "compiled_s": 0.25, "compile_s": 3.0}
    monkeypatch.setattr(loss_kernel_auto, "measure_loss_kernel", lambda *a: dict(timing))

    def cfg(arch: str, kernel: str):
        over = {"memory.loss_chunk": "64", "train.max_steps": "300", "train.loss_kernel": kernel}
        return load_config(overrides=hf_overrides(hf_folder(arch, weights=False), **over))

    phi = resolve(cfg("phi", "auto"), CPU)
    assert phi.config.train.loss_kernel == "eager"
    assert "a head with a bias" in phi.loss_kernel_timing["skipped"]
    # a run folder whose config.toml says compiled (auto chose it before heads were read)
    with pytest.warns(UserWarning, match="output layer has a bias.*ATen's run"):
        assert resolve(cfg("phi", "compiled"), CPU).config.train.loss_kernel == "eager"
    llama = resolve(cfg("llama", "auto"), CPU)
    assert llama.config.train.loss_kernel == "compiled"
    assert llama.loss_kernel_timing == timing | {"cached": False}


@pytest.mark.parametrize(
    "precision, vocab",
    [
        pytest.param("bf16", 8003, id="bf16-padded-vocabulary", marks=pytest.mark.slow),
        pytest.param("bf16", 8000, id="bf16"),
        pytest.param("fp32", 8003, id="fp32", marks=pytest.mark.slow),
    ],
)
def test_a_plan_of_the_compiled_kernels_follows_what_they_allocate(precision, vocab):
    """The plan's fake tensors run no inductor kernel: it follows their footprints, not ATen's
    path (which keeps two fp32 [chunk, vocab] blocks where the compiled kernel keeps one or
    none: 59% over at this shape in bf16)."""
    cfg = load_config(
        "tiny",
        overrides={"train.device": "cpu", "train.precision": precision,
                   "model.vocab_size": str(vocab), "model.d_model": "64", "model.n_layer": "2",
                   "model.n_head": "2", "model.seq_len": "256", "model.dropout": "0",
                   "model.attention": "sdpa", "train.batch_size": "8",
                   "train.micro_batch_size": "8", "memory.loss_chunk": "1024",
                   "train.loss_kernel": "compiled"},
    )  # fmt: skip
    planned = plan_memory(cfg).memory["peak"]
    _, measured = measure_real_step(cfg)
    assert planned == pytest.approx(measured["peak"], rel=0.03)
    eager = plan_memory(
        dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, loss_kernel="eager"))
    )
    if vocab == 8000 and precision == "bf16":  # no padding: the kernel keeps no fp32 block
        assert eager.memory["peak"] > 1.3 * measured["peak"]
