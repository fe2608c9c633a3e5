"""onegpu trains on each CPU kind it runs on, emulated on the machine at hand.

These machines come as AVX2-only EPYCs (bf16 emulated: every run fp32), AVX512-BF16 EPYCs and
AMX-BF16 Xeons; users' as AVX-512 Xeons without BF16 too (Cascade Lake, Ice Lake), where oneDNN
runs bf16 far slower than fp32. ATen's `ATEN_CPU_CAPABILITY` and oneDNN's `ONEDNN_MAX_CPU_ISA` cap the kernels a
process dispatches to, so one machine runs the other kinds' code paths (not at their speed):
`auto`'s precision (timed: techniques/precision.py), the bias epilogue pass (oneDNN bf16 only),
blocked attention, the compiled loss and regional compile must work under each. A cap only lowers what the CPU has: where the
CPU lacks an ISA, the runs take the same paths."""

import json
import math
import os
import subprocess
import sys

import pytest

from onegpu.perf.cpu import read_cpuinfo

KINDS = {
    "avx2": {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2"},
    "avx512": {"ATEN_CPU_CAPABILITY": "avx512", "ONEDNN_MAX_CPU_ISA": "AVX512_CORE"},
    "avx512-bf16": {"ATEN_CPU_CAPABILITY": "avx512", "ONEDNN_MAX_CPU_ISA": "AVX512_CORE_BF16"},
    "as-is": {},
}
BF16_FLAGS = {"avx512_bf16", "amx_bf16"}
BF16_CPU_AUTO = ["--model.attention", "blocked", "--train.compile", "regional",
                 "--train.loss_kernel", "compiled"]  # fmt: skip
"""What `auto` picks for long runs on the bf16 CPUs (benchmarks/step_cuts.py's AUTO_FLAGS)."""


def _train(tmp_path, kind: str) -> dict:
    out = tmp_path / kind
    env = {**os.environ, **KINDS[kind]}
    for var in ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA"):
        if var not in KINDS[kind]:
            env.pop(var, None)
    cmd = [sys.executable, "-m", "onegpu", "train", "--preset", "tiny", *BF16_CPU_AUTO,
           "--train.max_steps", "4", "--train.eval_every", "0", "--out.dir", str(out),
           "--out.progress", "false", "--out.save_checkpoint", "false"]  # fmt: skip
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads((out / "summary.json").read_text())


@pytest.mark.slow
def test_each_cpu_kind_trains_with_its_precision(tmp_path):
    """fp32 where the kernels are capped at AVX2 (bf16 emulated); elsewhere bf16 exactly where
    the run measured its bf16 matmuls the margin faster than fp32 ones (under the AVX-512 caps
    an AMX Xeon's are slower); the same training either way, bf16's rounding apart."""
    flags = set(read_cpuinfo().get("flags", "").split())
    runs = {kind: _train(tmp_path, kind) for kind in KINDS}
    assert runs["avx2"]["precision"] == "fp32"
    assert runs["avx2"]["precision_auto"] is None  # nothing to weigh: bf16 is emulated
    if flags & BF16_FLAGS:
        assert runs["as-is"]["precision_auto"] is not None
    for kind, summary in runs.items():
        if weighed := summary["precision_auto"]:
            pays = weighed["bf16_speedup"] >= weighed["margin"]
            assert summary["precision"] == ("bf16" if pays else "fp32"), (kind, weighed)
    reference = runs["avx2"]["loss"]
    for kind, summary in runs.items():
        assert math.isfinite(summary["loss"]), kind
        assert summary["loss"] == pytest.approx(reference, abs=5e-3), kind
