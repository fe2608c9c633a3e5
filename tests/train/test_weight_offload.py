"""Weights in host memory (memory.offload_params): FSDP2's CPU offload over a process group of
one, started in-process (no torchrun). On a CPU it trains bit for bit like the plain run,
resumes bit-exactly from its DCP checkpoints, and plans its weights, gradients and states as
host memory."""

import json

import pytest
import torch

from onegpu.config import ConfigError, load_config
from onegpu.plan.report import plan_report
from onegpu.train import train

STEPS = 6


def _cfg(out, **over):
    values = {"train.device": "cpu", "train.precision": "fp32", "train.max_steps": str(STEPS),
              "train.log_every": "1", "train.eval_every": "0", "train.measure_memory": "false",
              "checkpoint.every": "2", "out.progress": "false", "out.dir": str(out),
              "train.skip_memory_check": "true"}  # its plan steps the TrainStep counted below  # fmt: skip
    return load_config("tiny", overrides={**values, **over})


def _rows(out):
    lines = (out / "metrics.jsonl").read_text().splitlines()
    return [(r["step"], r["loss"], r["grad_norm"]) for r in map(json.loads, lines)]


def _weights(out):
    from safetensors.torch import load_file

    return load_file(out / "model.safetensors")


@pytest.mark.slow  # two runs (6 s)
def test_offloaded_weights_train_like_the_plain_run(tmp_path):
    plain = train(_cfg(tmp_path / "plain"))
    off = train(_cfg(tmp_path / "off", **{"memory.offload_params": "true"}))
    assert off["dist"]["cpu_offload"] and off["dist"]["world_size"] == 1
    assert off["dist"]["per_rank"][0]["param_device"] == "cpu"
    assert plain["steps"] == off["steps"] == STEPS
    assert _rows(tmp_path / "off") == _rows(tmp_path / "plain")
    a, b = _weights(tmp_path / "plain"), _weights(tmp_path / "off")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert (tmp_path / "off" / "checkpoints" / f"step-{STEPS:08d}").is_dir()  # DCP folders


@pytest.mark.slow  # three runs through FSDP2's CPU offload
def test_offloaded_weights_resume_bit_exactly(tmp_path, monkeypatch):
    from onegpu.backends.torch.step import TrainStep

    over = {"memory.offload_params": "true"}
    train(_cfg(tmp_path / "straight", **over))
    real, calls = TrainStep.__call__, {"n": 0}

    def stop_after_three(self, *args, **kwargs):
        out = real(self, *args, **kwargs)
        calls["n"] += 1
        if calls["n"] == 3:
            raise KeyboardInterrupt  # a crash after step 3: the step-2 checkpoint stays
        return out

    monkeypatch.setattr(TrainStep, "__call__", stop_after_three)
    with pytest.raises(KeyboardInterrupt):
        train(_cfg(tmp_path / "resumed", **over))
    monkeypatch.undo()
    train(_cfg(tmp_path / "resumed", **over, **{"train.resume": "auto"}))
    assert _rows(tmp_path / "resumed") == _rows(tmp_path / "straight")


def test_weight_offload_needs_fsdp():
    with pytest.raises(ConfigError, match="memory.offload_params"):
        load_config("tiny", overrides={"memory.offload_params": "true", "dist.strategy": "ddp"})


def test_the_plan_puts_weights_gradients_and_states_in_host_memory():
    over = {"train.device": "cpu", "train.precision": "fp32", "memory.loss_chunk": "0"}
    plain = plan_report(load_config("tiny", overrides=over), None, None)["memory"]
    off = plan_report(load_config("tiny", overrides={**over, "memory.offload_params": "true"}),
                      None, None)["memory"]  # fmt: skip
    assert off["params"] == off["grads"] == off["optimizer"] == 0
    assert off["host"] == 2 * plain["params"] + plain["optimizer"]  # weights, grads, states
    assert 0 < off["gathered"] < plain["params"] + plain["grads"]  # a block at a time, + root
