"""A step's matmul floor (perf/floor.py): every product of the step is found, at the shapes the
device runs, and each distinct one is timed once on this machine and cached."""

import pytest
import torch

from onegpu.backends.torch.floor import micro_batch_gemms, step_floor
from onegpu.config import load_config
from onegpu.perf import floor as floor_module
from onegpu.perf.floor import GemmRecorder, matmul_floor
from onegpu.perf.flops import attention_flops_per_token

CPU = torch.device("cpu")


def _cfg(**over):
    values = {"train.device": "cpu", "train.precision": "bf16", "train.compile": "none", **over}
    return load_config("tiny", overrides=values)


@pytest.mark.parametrize(("attention", "share"), [("sdpa", 0.5), ("plain", 1.0)])
def test_the_floor_holds_every_product_of_a_step(attention, share):
    """The products' FLOPs are the model's: 6 per matmul weight per token, plus attention's
    12 L T d per token, of which a causal fused kernel needs half (the plain path computes
    the whole T x T product, and its floor counts all of it)."""
    cfg = _cfg(**{"model.attention": attention})
    gemms = micro_batch_gemms(cfg, CPU)
    m = cfg.model
    tokens = cfg.train.micro_batch_size * cfg.train_seq_len
    weights = m.n_layer * 12 * m.d_model**2 + m.vocab_size * m.d_model  # qkv, o, mlp; tied head
    attention_flops = attention_flops_per_token(m.n_layer, cfg.train_seq_len, m.d_model)
    expected = tokens * (6 * weights + share * attention_flops)
    assert sum(g.flops for g in gemms) == pytest.approx(expected, rel=1e-9)
    assert {g.dtype for g in gemms if g.source == "matmul" and g.op != "bmm"} == {torch.bfloat16}


def test_fake_tensors_record_what_real_ones_do():
    """The trace runs on fake tensors; a real step dispatches the same products."""
    cfg = _cfg(
        **{"model.attention": "sdpa", "train.batch_size": "4", "train.micro_batch_size": "4"}
    )
    from onegpu.backends.torch.build import build

    built = build(cfg, CPU, with_data=False)
    x = torch.randint(0, cfg.model.vocab_size, (cfg.train.micro_batch_size, cfg.train_seq_len))
    with GemmRecorder() as real:
        built.step(x, x, x.numel(), 0)
    assert sorted(map(str, real.gemms)) == sorted(map(str, micro_batch_gemms(cfg, CPU)))


def test_each_distinct_product_is_timed_once_and_cached(monkeypatch, tmp_path):
    monkeypatch.setenv("ONEGPU_CACHE", str(tmp_path))  # nothing timed before this test
    cfg = _cfg(
        **{"model.attention": "sdpa", "train.batch_size": "16", "train.micro_batch_size": "8"}
    )
    timed = []
    real_time = floor_module.time_gemm

    def counting(gemm, device, runs_as=None):
        timed.append(gemm)
        return real_time(gemm, device, runs_as)

    monkeypatch.setattr(floor_module, "time_gemm", counting)
    gemms = micro_batch_gemms(cfg, CPU)
    first = step_floor(cfg, CPU)
    # repeated layers' products (and attention's forward and backward ones of one shape) once
    assert len(timed) == len({g.key() for g in gemms}) < len(gemms)
    again = step_floor(cfg, CPU)
    assert len(timed) == len(set(timed))  # nothing timed twice: the cache answered
    assert again.seconds == first.seconds > 0
    assert first.seconds == pytest.approx(sum(n * s for _, n, s in first.calls))
    one = matmul_floor(gemms, CPU)
    assert cfg.grad_accum_steps == 2
    assert first.seconds == pytest.approx(2 * one.seconds)  # both micro-batches
    assert first.flops == pytest.approx(2 * sum(g.flops for g in gemms))
    by_source = first.by_source()
    assert set(by_source) == {
        "matmul",
        "_scaled_dot_product_flash_attention_for_cpu",
        "_scaled_dot_product_flash_attention_for_cpu_backward",
    }
    assert sum(by_source.values()) == pytest.approx(first.seconds)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_on_a_gpu_the_floor_times_each_product_on_the_gpu(tmp_path):
    """The same trace, timed with the device synchronised around each product; a run's
    summary holds its step against it."""
    from onegpu.train import train

    cuda = torch.device("cuda")
    cfg = _cfg(**{"train.device": "cuda", "model.attention": "sdpa"})
    floor = step_floor(cfg, cuda)
    assert floor.seconds > 0 and floor.flops == pytest.approx(
        cfg.grad_accum_steps * sum(g.flops for g in micro_batch_gemms(cfg, cuda))
    )
    run = _cfg(**{"train.device": "cuda", "train.max_steps": "20", "out.dir": str(tmp_path)})
    summary = train(run)
    assert summary["floor_s"] > 0 and summary["step_over_floor"] > 1


def test_a_floor_above_its_step_is_timed_again_once(monkeypatch):
    """A floor timed while something else ran would stay cached for every later run: one
    above the step it bounds is measured again (refresh), once."""
    from onegpu.backends.torch import floor as torch_floor

    asked = []

    def fake_floor(cfg, device, *, refresh=False):
        asked.append(refresh)
        return matmul_floor([], device) if refresh else floor_module.Floor(5.0, 1.0, [])

    monkeypatch.setattr(torch_floor, "step_floor", fake_floor)
    assert torch_floor.checked_floor(_cfg(), CPU, step_s=1.0).seconds == 0.0
    assert asked == [False, True]
    asked.clear()
    assert torch_floor.checked_floor(_cfg(), CPU, step_s=10.0).seconds == 5.0
    assert asked == [False]


def test_a_refresh_keeps_the_faster_of_its_time_and_the_stored_one(monkeypatch, tmp_path):
    """A product's floor is the least it has been seen to take: timed again in a slow moment
    of a shared machine, it does not go up; timed faster, it comes down."""
    monkeypatch.setenv("ONEGPU_CACHE", str(tmp_path))
    gemms = [floor_module.Gemm("mm", (((4, 8), (8, 1)), ((8, 2), (2, 1))), torch.float32)]
    times = iter([0.5, 0.9, 0.2])
    monkeypatch.setattr(floor_module, "time_gemm", lambda gemm, device, runs_as: next(times))
    assert matmul_floor(gemms, CPU).seconds == 0.5
    assert matmul_floor(gemms, CPU, refresh=True).seconds == 0.5  # timed 0.9: kept 0.5
    assert matmul_floor(gemms, CPU).seconds == 0.5  # and stored so
    assert matmul_floor(gemms, CPU, refresh=True).seconds == 0.2
    assert matmul_floor(gemms, CPU).seconds == 0.2


def test_a_refresh_in_a_busy_moment_keeps_the_stored_time(monkeypatch, tmp_path):
    """A refresh whose threads waited for the CPUs is not stored; the faster time stored
    before stays the product's floor for later runs (not dropped to be timed afresh)."""
    import contextlib

    from onegpu.perf import contention

    class Busy:
        def watching(self):
            return contextlib.nullcontext()

        def disturbed(self):
            return True

        def wait_share(self):
            return 0.5

    monkeypatch.setenv("ONEGPU_CACHE", str(tmp_path))
    gemms = [floor_module.Gemm("mm", (((4, 8), (8, 1)), ((8, 2), (2, 1))), torch.float32)]
    times = iter([0.5, 0.9, 0.7])
    monkeypatch.setattr(floor_module, "time_gemm", lambda gemm, device, runs_as: next(times))
    assert matmul_floor(gemms, CPU).seconds == 0.5
    with monkeypatch.context() as busy:
        busy.setattr(contention, "RunQueueWatch", Busy)
        with pytest.warns(UserWarning, match="matmul floor"):
            assert matmul_floor(gemms, CPU, refresh=True).seconds == 0.5  # timed 0.9
    contention._UNSTORED.clear()  # a later process
    assert matmul_floor(gemms, CPU).seconds == 0.5  # read, not timed again (0.7 unused)


def test_the_largest_products_are_named_with_their_layout_and_rate():
    """A weight gradient's first operand is a transposed view (`^T`); its rate alone is its
    FLOPs over its time (2 x 384 x 4,096 x 384 in 2 ms)."""
    wgrad = floor_module.Gemm(
        "mm", (((384, 4096), (1, 384)), ((4096, 384), (384, 1))), torch.bfloat16
    )
    fwd = floor_module.Gemm("mm", (((4096, 384), (384, 1)), ((384, 384), (1, 384))), torch.bfloat16)
    floor = floor_module.Floor(0.0, 0.0, [(fwd, 4, 0.001), (wgrad, 4, 0.002)])
    first, second = floor.largest()
    assert "8.0 ms    4 x mm [384x4096]^T x [4096x384]  604 GFLOP/s" in first
    assert "[4096x384] x [384x384]^T" in second and "4.0 ms" in second


def test_the_timing_key_holds_the_fp32_matmul_settings(monkeypatch):
    """TF32 (a GPU) or oneDNN's reduced fp32 (a CPU) change an fp32 product's time: a run with
    them on never reads the floor timed with them off."""
    before = floor_module.timing_key(CPU)
    monkeypatch.setattr(torch, "get_float32_matmul_precision", lambda: "medium")
    assert floor_module.timing_key(CPU) != before
