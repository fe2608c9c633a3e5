"""MFU's CPU denominator: keyed by what sets the rate, the best of several runs, shown with its
source, re-measured on request and when a run beats it."""

from __future__ import annotations

import itertools
import types

import pytest
import torch

from onegpu.backends.torch.report import recheck_peak
from onegpu.perf import devices
from onegpu.tools.info import device_info, format_info


def test_the_key_holds_the_rate_flags_not_only_the_name(monkeypatch):
    monkeypatch.setattr(devices, "_cpuinfo", lambda: {"model name": "AMD EPYC",
                        "flags": "fpu avx2 fma avx512f avx512_bf16", "cpu MHz": "2445.4"})  # fmt: skip
    zen4 = devices.cpu_peak_key(torch.bfloat16)
    monkeypatch.setattr(devices, "_cpuinfo", lambda: {"model name": "AMD EPYC",
                        "flags": "fpu avx2 fma", "cpu MHz": "2445.4"})  # fmt: skip
    zen2 = devices.cpu_peak_key(torch.bfloat16)
    assert zen4 != zen2
    assert "avx512_bf16" in zen4 and "avx512" not in zen2 and "2.4GHz" in zen2


def test_the_best_run_counts_not_the_median(monkeypatch):
    times = iter([1.0, 1.0] + [4.0, 2.0, 1.0, 3.0, 4.0, 4.0, 4.0])  # warm-up, probe, 7 runs
    monkeypatch.setattr(devices, "_time_mm", lambda a, b, d: next(times))
    flops = devices.measure_matmul_flops(torch.float32, torch.device("cpu"), n=512)
    assert flops == pytest.approx(2 * 512**3 / 1.0)


def test_refresh_measures_again_and_info_shows_the_source(monkeypatch):
    rates = (n * 1e9 for n in itertools.count(1))  # each measurement: 1, 2, 3... GFLOP/s
    monkeypatch.setattr(devices, "measure_matmul_flops", lambda *a, **k: next(rates))
    monkeypatch.setattr(devices, "_cpuinfo", lambda: {"model name": "Test CPU 1", "flags": "avx2"})
    first = devices.cpu_peak(torch.float32)
    assert devices.cpu_peak(torch.float32).flops == first.flops == 1e9  # cached
    assert devices.cpu_peak(torch.float32, refresh=True).flops == 2e9
    import onegpu.tools.info as info_mod

    monkeypatch.setattr(info_mod, "cpu_peak", devices.cpu_peak)
    text = format_info(device_info(measure=True))
    assert "rate key: Test CPU 1|avx2" in text and "measured fp32 matmul peak: 2 GFLOP/s" in text
    assert "cached under Test CPU 1|avx2" in text
    text = format_info(device_info(measure=True, refresh=True))  # bf16 was 3; fp32 now 4
    assert "measured fp32 matmul peak: 4 GFLOP/s" in text


def test_info_says_what_auto_precision_takes_on_the_cpu_and_why(monkeypatch):
    import onegpu.tools.info as info_mod

    monkeypatch.setattr(info_mod, "bf16_native", lambda device: True)
    amx = info_mod._cpu_auto_precision({"fp32": 373e9, "bf16": 2366e9})
    assert amx == "bf16 (bf16 matmuls 6.34x fp32's; bf16 needs 1.1x)"
    capped = info_mod._cpu_auto_precision({"fp32": 370e9, "bf16": 213e9})
    assert capped.startswith("fp32 (bf16 matmuls 0.58x fp32's")
    monkeypatch.setattr(info_mod, "bf16_native", lambda device: False)
    assert info_mod._cpu_auto_precision({"fp32": 1e9, "bf16": 9e9}).startswith("fp32 (bf16 is")


def test_a_run_faster_than_the_cached_peak_refreshes_it(monkeypatch):
    rates = iter([1e9, 5e9])
    monkeypatch.setattr(devices, "measure_matmul_flops", lambda *a, **k: next(rates))
    monkeypatch.setattr(devices, "_cpuinfo", lambda: {"model name": "Test CPU 2", "flags": "avx2"})
    assert devices.cpu_peak(torch.float32).flops == 1e9
    built = types.SimpleNamespace(
        device=torch.device("cpu"),
        policy=types.SimpleNamespace(compute_dtype=torch.float32),
        dist=types.SimpleNamespace(is_main=True),
    )
    recheck_peak(built, {"mfu": 0.9, "peak_flops": 1e9})  # plausible: kept
    assert devices.cpu_peak(torch.float32).flops == 1e9
    with pytest.warns(UserWarning, match="measured again, 5 GFLOP/s"):
        recheck_peak(built, {"mfu": 1.4, "peak_flops": 1e9})
    assert devices.cpu_peak(torch.float32).flops == 5e9
