"""Runs that survive: periodic crash-safe checkpoints, bit-exact resume, graceful signals.

The grid runs in the default suite for fp32, bf16-pure, fp16 and the optimizer in backward,
and in the slow suite for the rest."""

import json
import os
import signal

import pytest
import torch

from onegpu.config import load_config
from onegpu.step import TrainStep
from onegpu.train import checkpoint as ckpt
from onegpu.train.trainer import train

STEPS = 8


def _cfg(out, **over):
    values = {
        "train.device": "cpu",
        "train.max_steps": str(STEPS),
        "train.log_every": "1",
        "train.eval_every": "4",
        "train.measure_memory": "false",
        "checkpoint.every": "2",
        "out.progress": "false",
        "out.dir": str(out),
        **over,
    }
    return load_config("tiny", overrides=values)


def _stop_after(monkeypatch, n: int, sig=signal.SIGTERM):
    """Send this process `sig` during step n (as a scheduler would), once."""
    real = TrainStep.__call__
    calls = {"n": 0}

    def step(self, *args, **kwargs):
        out = real(self, *args, **kwargs)
        calls["n"] += 1
        if calls["n"] == n:
            os.kill(os.getpid(), sig)
        return out

    monkeypatch.setattr(TrainStep, "__call__", step)


def _losses(out):
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [(r["step"], r.get("loss"), r.get("val_loss")) for r in rows]


def _weights(out):
    state = torch.load(out / "checkpoints" / ckpt.checkpoint_name(STEPS), weights_only=True)
    return state["model"]


GRID = {
    "fp32": {"train.precision": "fp32"},
    "bf16-dropout": {"train.precision": "bf16", "model.dropout": "0.1"},
    "bf16-pure": {"train.precision": "bf16-pure"},
    "fp16": {"train.precision": "fp16"},
    "sgd-accum": {"optim.name": "sgd", "train.micro_batch_size": "2"},
    "adafactor-selective": {"optim.name": "adafactor", "memory.checkpointing": "selective"},
    "randomized-linear": {"memory.randomized_linear": "0.5", "model.dropout": "0.1"},
    "in-backward": {"optim.in_backward": "true", "optim.grad_clip": "0",
                    "train.micro_batch_size": "8"},
}  # fmt: skip


SLOW = {"bf16-dropout", "sgd-accum", "adafactor-selective", "randomized-linear"}


@pytest.mark.parametrize(
    "name", [pytest.param(n, marks=pytest.mark.slow) if n in SLOW else n for n in GRID]
)
def test_a_resumed_run_continues_bit_exactly(name, tmp_path, monkeypatch):
    over = GRID[name]
    train(_cfg(tmp_path / "straight", **over))
    _stop_after(monkeypatch, 3)  # off a checkpoint step: resume from step 2 redoes step 3
    s = train(_cfg(tmp_path / "resumed", **over))
    assert s["interrupted"] and s["steps"] == 3
    monkeypatch.undo()
    train(_cfg(tmp_path / "resumed", **{**over, "train.resume": "auto"}))
    assert _losses(tmp_path / "resumed") == _losses(tmp_path / "straight")
    a, b = _weights(tmp_path / "straight"), _weights(tmp_path / "resumed")
    for k in a:
        assert torch.equal(a[k], b[k]), k
