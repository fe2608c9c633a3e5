"""Launching `onegpu train` as a user does, on this CPU: one process, or torchrun's processes
with the gloo backend (the tests of several processes share these)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

STEPS = 4
BASE = {
    "train.max_steps": STEPS,
    "train.batch_size": 8,
    "train.log_every": 1,
    "train.eval_every": 0,
    "train.device": "cpu",
    "train.precision": "fp32",  # `auto` is bf16 on CPUs with AVX512-BF16: compare in fp32
    "checkpoint.every": 2,
    "checkpoint.keep_last": 5,
    "out.progress": "false",
}
REL = 1e-5


def _args(out: Path, over: dict) -> list[str]:
    values = {**BASE, **over, "out.dir": str(out)}
    return ["--preset", "tiny", *(f"--{k}={v}" for k, v in values.items())]


def launch(out: Path, nproc: int, *, check: bool = True, **over) -> subprocess.CompletedProcess:
    """`onegpu train` on `nproc` processes (1: a plain process, no torchrun)."""
    if nproc == 1 and over.get("dist.strategy", "none") == "none":
        cmd = [sys.executable, "-m", "onegpu", "train"]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               f"--nproc-per-node={nproc}", "-m", "onegpu", "train"]  # fmt: skip
    proc = subprocess.run(
        cmd + _args(out, over), capture_output=True, text=True, timeout=300, env=_env()
    )
    if check:
        assert proc.returncode == 0, _crash(proc.stderr) + proc.stderr[-3000:]
    return proc


def _env() -> dict[str, str]:
    # a process that crashes (a signal) prints its Python stack: torchrun's report has none
    return {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "PYTHONUNBUFFERED": "1",
        "PYTHONFAULTHANDLER": "1",
    }


def _crash(stderr: str) -> str:
    """The stack a crashed process printed (faulthandler's), which torchrun's report of the
    other processes would push out of the message's tail."""
    start = stderr.find("Fatal Python error")
    return "" if start < 0 else stderr[start : start + 3000] + "\n...\n"


def losses(out: Path) -> dict[int, float]:
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in rows if "loss" in r}


def assert_same_losses(a: dict[int, float], b: dict[int, float]) -> None:
    assert a.keys() == b.keys(), (a, b)
    for step in a:
        assert a[step] == pytest.approx(b[step], rel=REL), (step, a, b)
