import pytest
import torch

from onegpu import train as trainer
from onegpu.backends.torch.build import build
from onegpu.config import load_config


def _run(tmp_path, precision, steps=30, **extra):
    over = {
        "train.device": "cpu",
        "train.precision": precision,
        "train.max_steps": str(steps),
        "train.eval_every": "0",
        "out.progress": "false",
        "out.save_checkpoint": "false",
        "out.dir": str(tmp_path / precision),
        **extra,
    }
    return trainer.train(load_config("tiny", overrides=over))


@pytest.mark.slow
def test_bf16_and_fp16_track_fp32_loss(tmp_path):
    """Same seed, data and init: after 30 steps mixed precision stays within 0.02 nats of fp32
    (measured here: differences under 0.001), and all three learn (loss falls from ~5.5)."""
    ref = _run(tmp_path, "fp32")
    assert ref["precision"] == "fp32" and ref["loss"] < 4.0
    for precision in ("bf16", "fp16"):
        s = _run(tmp_path, precision)
        assert s["precision"] == precision
        assert abs(s["loss"] - ref["loss"]) < 0.02, (precision, s["loss"], ref["loss"])
    assert s["skipped_steps"] == 0


def test_auto_precision_resolves_per_device():
    from onegpu.config import ConfigError
    from onegpu.techniques.precision import (
        DeviceCaps,
        auto_takes_bf16,
        device_caps,
        resolve_precision,
    )

    cpu = torch.device("cpu")
    expected = "bf16" if auto_takes_bf16(device_caps(cpu)) else "fp32"
    assert resolve_precision("auto", cpu).name == expected
    assert resolve_precision("bf16", cpu).autocast_dtype is torch.bfloat16
    assert resolve_precision("fp16", cpu).loss_scaling
    # a GPU that is not here, from its capabilities (the planner's case)
    a100 = DeviceCaps(type="cuda", bf16=True, tf32=True)
    t4 = DeviceCaps(type="cuda", bf16=False, tf32=False)
    assert resolve_precision("auto", a100).name == "bf16"
    assert resolve_precision("tf32", a100).name == "tf32"
    assert resolve_precision("auto", t4).name == "fp32"
    with pytest.raises(ConfigError, match="train.precision"):
        resolve_precision("bf16", t4)


def test_auto_takes_bf16_on_a_cpu_only_where_its_bf16_matmuls_are_faster(monkeypatch):
    """Native bf16 is not enough on a CPU: oneDNN's AVX512-BF16 kernels on an Intel Xeon run
    slower than its fp32 ones. An emulated bf16 is never measured."""
    from onegpu.techniques import precision
    from onegpu.techniques.precision import CPU_BF16_MARGIN, DeviceCaps, resolve_precision

    def cpu(bf16: bool, speedup: float | None = None) -> DeviceCaps:
        return DeviceCaps(type="cpu", bf16=bf16, tf32=False, bf16_speedup=speedup)

    assert resolve_precision("auto", cpu(True, 6.1)).name == "bf16"  # AMX
    assert resolve_precision("auto", cpu(True, 0.7)).name == "fp32"  # AVX512-BF16 on a Xeon
    assert resolve_precision("auto", cpu(True, CPU_BF16_MARGIN * 0.99)).name == "fp32"
    assert resolve_precision("bf16", cpu(True, 0.7)).name == "bf16"  # asked for: as asked
    monkeypatch.setattr(precision, "cpu_bf16_speedup", lambda: 0.7)
    assert resolve_precision("auto", cpu(True)).name == "fp32"  # measured when not given
    monkeypatch.setattr(precision, "cpu_bf16_speedup", lambda: pytest.fail("measured"))
    assert resolve_precision("auto", cpu(False)).name == "fp32"  # AVX2: emulated, not timed
    a100 = DeviceCaps(type="cuda", bf16=True, tf32=True)
    assert resolve_precision("auto", a100).name == "bf16"  # a GPU's native bf16: not timed


def test_a_capped_onednn_is_another_cpu_for_the_timing_caches(monkeypatch):
    """ONEDNN_MAX_CPU_ISA changes the matmul rates, so cached peaks must not cross it."""
    from onegpu.perf.devices import cpu_identity

    monkeypatch.delenv("ONEDNN_MAX_CPU_ISA", raising=False)
    monkeypatch.delenv("DNNL_MAX_CPU_ISA", raising=False)
    plain = cpu_identity()
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX512_CORE_BF16")
    assert cpu_identity() == f"{plain}|onednn<=avx512_core_bf16"


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_autocast_runs_matmuls_in_low_precision_on_cpu(precision, tiny_cfg):
    """Autocast must be asked for on the CPU too, or training silently runs fp32."""
    tiny_cfg.train.precision = precision
    built = build(tiny_cfg, torch.device("cpu"), with_data=False)
    x = torch.randint(0, 256, (2, 16))
    with built.policy.autocast(built.device):
        logits = built.model(x)
    assert logits.dtype == built.policy.autocast_dtype
    assert all(p.dtype == torch.float32 for p in built.model.parameters())  # fp32 master weights
