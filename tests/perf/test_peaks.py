"""A JAX run's MFU is measured against the peak torch measured on this CPU (read torch-free)."""

from __future__ import annotations

import json

from onegpu.perf.cpu import hardware_key, read_cpuinfo
from onegpu.perf.devices import cpu_identity
from onegpu.perf.peaks import cached_cpu_peak


def test_the_torch_key_starts_with_the_torch_free_one():
    assert cpu_identity().startswith(hardware_key(read_cpuinfo()) + "|")


def test_the_newest_peak_of_this_cpu_threads_and_dtype_is_read(tmp_path, monkeypatch):
    monkeypatch.setenv("ONEGPU_CACHE", str(tmp_path))
    hw = hardware_key(read_cpuinfo())
    (tmp_path / "cpu-peaks.json").write_text(json.dumps({
        f"{hw}|AVX512|threads=2|torch=2.12|torch.float32": {"flops": 1e11, "measured": "2026-01-01T00:00:00"},
        f"{hw}|AVX512|threads=2|torch=2.13|torch.float32": {"flops": 2e11, "measured": "2026-02-01T00:00:00"},
        f"{hw}|AVX512|threads=1|torch=2.13|torch.float32": {"flops": 9e11, "measured": "2026-03-01T00:00:00"},
        f"{hw}|AVX512|threads=2|torch=2.13|torch.bfloat16": {"flops": 4e11, "measured": "2026-03-01T00:00:00"},
        "Other CPU|avx2|2.0GHz|AVX2|threads=2|torch=2.13|torch.float32": {"flops": 8e11, "measured": "2026-04-01T00:00:00"},
    }))  # fmt: skip
    assert cached_cpu_peak("fp32", threads=2).flops == 2e11
    assert cached_cpu_peak("bf16", threads=2).flops == 4e11
    assert cached_cpu_peak("fp32", threads=4) is None
