"""The README's main command, run as a user would (a fresh process)."""

import json
import subprocess
import sys

import tomllib
import torch

from onegpu.config import load_config


def test_train_tiny_end_to_end(tmp_path):
    out = tmp_path / "run"
    cmd = [
        sys.executable,
        "-m",
        "onegpu",
        "train",
        "--preset",
        "tiny",
        "--train.max_steps",
        "30",
        "--train.device",
        "cpu",
        "--out",
        str(out),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr

    files = {p.name for p in out.iterdir()}
    assert {"config.toml", "metrics.jsonl", "summary.json", "checkpoints"} <= files
    assert (out / "checkpoints" / "step-00000030.pt").exists() and "model.safetensors" in files
    state = torch.load(out / "checkpoints" / "step-00000030.pt", weights_only=True)
    assert state["step"] == 30 and {"model", "optimizer", "rng", "config"} <= set(state)

    resolved = tomllib.loads((out / "config.toml").read_text())
    assert resolved["train"]["max_steps"] == 30
    assert resolved["train"]["precision"] in ("bf16", "fp32")  # 'auto' is written resolved
    ran, preset = load_config(None, out / "config.toml").model, load_config("tiny").model
    assert ran.attention in ("sdpa", "plain", "blocked")  # 'auto' is written resolved too
    ran.attention = preset.attention
    assert ran == preset

    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    train_rows = [r for r in rows if "loss" in r]
    eval_rows = [r for r in rows if "val_loss" in r]
    for r in train_rows:
        assert {
            "step",
            "loss",
            "lr",
            "tokens_per_s",
            "mfu",
            "step_time_s",
            "peak_mem_bytes",
        } <= r.keys()
    assert [r["step"] for r in train_rows] == [5, 10, 15, 20, 25, 30]
    assert train_rows[-1]["loss"] < train_rows[0]["loss"] - 1.0  # it learns
    assert [r["step"] for r in eval_rows] == [10, 20, 30]

    summary = json.loads((out / "summary.json").read_text())
    for key in (
        "params",
        "tokens",
        "tokens_per_s",
        "mfu",
        "peak_mem_bytes",
        "val_loss",
        "device",
        "torch",
    ):
        assert summary[key] is not None, key
    assert summary["params"] == 120_576
    assert summary["tokens"] == 30 * 8 * 64
    assert summary["val_loss"] == eval_rows[-1]["val_loss"]
    assert 0 < summary["mfu"] < 1
    # the step against its matmul floor (perf/floor.py); how far above it is a timing, not
    # checked here (tests/perf/test_floor.py checks what the floor holds)
    assert summary["floor_s"] > 0
    assert summary["step_over_floor"] == summary["step_time_s"] / summary["floor_s"]
    assert summary["peak_mem_bytes"] > 50 * 2**20  # a real process measurement, not a formula
