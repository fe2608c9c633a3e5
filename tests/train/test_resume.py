"""Runs that survive: periodic crash-safe checkpoints, bit-exact resume, graceful signals.

The grid runs in the default suite for fp32, bf16-pure, fp16 and the optimizer in backward,
and in the slow suite for the rest."""

import json
import os
import signal
from pathlib import Path

import pytest
import torch

from onegpu.backends.torch import checkpoint as ckpt
from onegpu.backends.torch.step import TrainStep
from onegpu.config import ConfigError, load_config
from onegpu.runs import checkpoints
from onegpu.train import train

STEPS = 8


def _cfg(out, **over):
    values = {
        "train.device": "cpu",
        "train.max_steps": str(STEPS),
        "train.log_every": "3",
        "train.eval_every": "4",
        "train.measure_memory": "false",
        "train.skip_memory_check": "true",  # its plan steps a TrainStep, which _stop_after counts
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
    "in-backward-accum": {"optim.in_backward": "true", "optim.grad_clip": "0",
                          "train.micro_batch_size": "2"},
    "in-backward-host": {"optim.in_backward": "true", "optim.grad_clip": "0",
                         "memory.offload_optimizer": "true", "train.micro_batch_size": "2"},
    "states-on-host-in-backward": {"optim.in_backward": "true", "optim.grad_clip": "0",
                                   "memory.offload_states": "true"},
    "states-on-host-8bit-clip": {"optim.name": "adamw8bit", "train.precision": "bf16",
                                 "memory.offload_states": "true", "optim.grad_clip": "0.5",
                                 "train.micro_batch_size": "2"},
    "adamw8bit-bf16": {"optim.name": "adamw8bit", "train.precision": "bf16"},
    "adamw4bit-bf16-pure": {"optim.name": "adamw4bit", "train.precision": "bf16-pure"},
    "lamb-accum": {"optim.name": "lamb", "train.micro_batch_size": "2"},
    "lars-scaled": {"optim.name": "lars", "optim.lr_scaling": "sqrt", "optim.base_batch": "2"},
    "attn": {"memory.checkpointing": "attn", "model.dropout": "0.1"},
    "mlp": {"memory.checkpointing": "mlp", "model.dropout": "0.1"},
    "attn+mlp": {"memory.checkpointing": "attn+mlp", "model.dropout": "0.1"},
    "block-chunked": {"memory.checkpointing": "block", "memory.loss_chunk": "96"},
    "every:2-offload": {"memory.checkpointing": "every:2", "memory.offload_activations": "true"},
    "gelu-2bit": {"memory.gelu_bits": "2"},
    "offload-optimizer": {"memory.offload_optimizer": "true", "train.micro_batch_size": "2",
                          "optim.grad_clip": "0.5"},
    # bf16 matmul weights on the device, fp32 masters on the host (and in the checkpoint)
    "offload-optimizer-bf16": {"memory.offload_optimizer": "true", "train.precision": "bf16",
                               "train.micro_batch_size": "2"},
    # a new projection every 3 steps: one falls after the resume point (step 2)
    "galore-accum-clip": {"optim.name": "galore", "optim.rank": "16", "optim.update_proj_gap": "3",
                          "train.micro_batch_size": "2", "optim.grad_clip": "0.5"},
    "apollo-mini-dropout": {"optim.name": "apollo-mini", "optim.update_proj_gap": "3",
                            "model.dropout": "0.1"},
    "adam-mini-accum": {"optim.name": "adam-mini", "train.micro_batch_size": "2"},
    "apollo-in-backward-host": {"optim.name": "apollo", "optim.rank": "16",
                                "optim.update_proj_gap": "3", "optim.in_backward": "true",
                                "optim.grad_clip": "0", "memory.offload_optimizer": "true",
                                "train.micro_batch_size": "2"},
    # instruction and chat data (made per test: CHAT / ARITHMETIC name the file)
    "chat-one-a-row": {"data.source": "CHAT", "model.dropout": "0.1",
                       "train.micro_batch_size": "2"},
    "prompt-response-stream": {"data.source": "ARITHMETIC", "data.packing": "stream"},
    "prompt-response-bfd": {"data.source": "ARITHMETIC", "data.packing": "bfd",
                            "model.seq_len": "128", "model.dropout": "0.1",
                            "train.micro_batch_size": "2"},
}  # fmt: skip


FAST = {"fp32"}  # the rest of the grid runs in the slow suite (CI runs both)


@pytest.mark.parametrize(
    "name", [n if n in FAST else pytest.param(n, marks=pytest.mark.slow) for n in GRID]
)
def test_a_resumed_run_continues_bit_exactly(name, tmp_path, monkeypatch):
    over = {k: _data_file(v, tmp_path) for k, v in GRID[name].items()}
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


def _data_file(value: str, folder) -> str:
    """A GRID value, or the data file it names, written into `folder`."""
    import sys

    if value not in ("CHAT", "ARITHMETIC"):
        return value
    sys.path.insert(0, str(Path(__file__).parents[1] / "data"))
    from instruction_sets import arithmetic_rows, chat_rows, write_jsonl

    rows = chat_rows(120) if value == "CHAT" else arithmetic_rows(300)
    return str(write_jsonl(folder / f"{value.lower()}.jsonl", rows))


def _run_cli(args, **kw):
    import subprocess
    import sys

    cmd = [sys.executable, "-m", "onegpu", "train", "--preset", "tiny", "--train.device", "cpu",
           "--out.progress", "false", "--train.eval_every", "0",
           "--train.compile", "none", "--train.gelu_kernel", "eager", *args]  # fmt: skip
    # compile and the GELU kernel pinned: a long run would time them before its first step
    env = {**os.environ, "ONEGPU_ALLOCATOR": "system"}
    return subprocess.Popen(cmd, env=env, stderr=subprocess.PIPE, text=True, **kw)


@pytest.mark.slow
@pytest.mark.parametrize(("sig", "code"), [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_a_signal_finishes_the_step_checkpoints_and_exits_128_plus_its_number(sig, code, tmp_path):
    import time

    out = tmp_path / "run"
    proc = _run_cli(["--train.max_steps", "100000", "--train.log_every", "1000", "--out", str(out)])
    deadline = time.time() + 120
    while not (out / "metrics.jsonl").exists() and time.time() < deadline:
        time.sleep(0.2)  # the run folder is opened once training has started
    time.sleep(1.0)
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == code, err
    summary = json.loads((out / "summary.json").read_text())
    assert summary["interrupted"] and summary["signal"] == sig.name and summary["steps"] > 0
    found = checkpoints.complete_checkpoints(out / "checkpoints")
    assert [s for s, _ in found] == [summary["steps"]]
    rows = (out / "metrics.jsonl").read_text().splitlines()
    assert json.loads(rows[-1])["step"] == summary["steps"]  # the partial interval is logged
    assert "--train.resume auto" in err


def test_resume_refuses_a_changed_trajectory_and_bad_checkpoints(tmp_path):
    out = tmp_path / "run"
    train(_cfg(out, **{"train.max_steps": "2"}))
    with pytest.raises(ConfigError, match=r"^optim.lr: .*trained with 0.003"):
        train(_cfg(out, **{"train.resume": "auto", "optim.lr": "0.1"}))
    with pytest.raises(ConfigError, match=r"^out.dir: .*--train.resume auto"):
        train(_cfg(out))  # a folder holding a run is never reused by accident
    bad = tmp_path / "bad.pt"
    good = checkpoints.complete_checkpoints(out / "checkpoints")[-1][1]
    bad.write_bytes(good.read_bytes()[: good.stat().st_size // 2])  # killed mid-copy
    with pytest.raises(ConfigError, match=r"^train.resume: .*corrupt, truncated"):
        train(_cfg(tmp_path / "other", **{"train.resume": str(bad)}))
    torch.save({"weights": torch.zeros(2)}, bad)
    with pytest.raises(ConfigError, match=r"^train.resume: .*not an onegpu training checkpoint"):
        train(_cfg(tmp_path / "other", **{"train.resume": str(bad)}))


@pytest.mark.slow  # shared by both backends now: tests/runs/test_lifecycle.py
def test_leftovers_of_a_killed_save_are_removed_and_never_loaded(tmp_path):
    out = tmp_path / "run"
    train(_cfg(out, **{"train.max_steps": "4"}))
    folder = out / "checkpoints"
    leftover = folder / f"{checkpoints.TMP_PREFIX}step-00000006.pt.1234"
    leftover.write_bytes(b"PK\x03\x04 half a zip")
    s = train(_cfg(out, **{"train.resume": "auto", "train.max_steps": "6"}))
    assert s["steps"] == 6 and not leftover.exists()
    assert [step for step, _ in checkpoints.complete_checkpoints(folder)] == [2, 4, 6][-3:]


@pytest.mark.slow  # shared by both backends now: tests/runs/test_lifecycle.py
def test_keep_last_and_keep_every(tmp_path):
    out = tmp_path / "run"
    train(_cfg(out, **{"train.max_steps": "12", "checkpoint.every": "1",
                       "checkpoint.keep_last": "2", "checkpoint.keep_every": "5"}))  # fmt: skip
    assert [s for s, _ in checkpoints.complete_checkpoints(out / "checkpoints")] == [5, 10, 11, 12]


@pytest.mark.slow  # shared by both backends now: tests/runs/test_lifecycle.py
def test_overwrite_replaces_the_whole_old_run(tmp_path):
    out = tmp_path / "run"
    train(_cfg(out, **{"train.max_steps": "6"}))
    train(_cfg(out, **{"train.max_steps": "2", "out.overwrite": "true"}))
    assert [s for s, _ in checkpoints.complete_checkpoints(out / "checkpoints")] == [2]
    assert max(json.loads(r)["step"] for r in (out / "metrics.jsonl").read_text().splitlines()) == 2


@pytest.mark.slow  # the fix list plans a dozen variants
def test_out_of_memory_is_answered_with_the_planners_cheapest_fixes(tmp_path, monkeypatch, capsys):
    """Injected on CPU: the allocator's error at step 3, after a checkpoint at step 2."""
    from onegpu.cli import main

    real = TrainStep.__call__

    def step(self, inputs, targets, n_tokens, index, positions=None):
        if index == 2:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return real(self, inputs, targets, n_tokens, index, positions)

    monkeypatch.setattr(TrainStep, "__call__", step)
    out = tmp_path / "run"
    code = main(["train", "--preset", "tiny", "--train.device", "cpu", "--out", str(out),
                 "--out.progress", "false", "--checkpoint.every", "2"])  # fmt: skip
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1, err
    assert err[0].startswith("onegpu: error: out of memory: out of memory at step 3 on cpu")
    assert "cheapest changes" in err[0] and "--" in err[0]
    assert [s for s, _ in checkpoints.complete_checkpoints(out / "checkpoints")] == [2]


@pytest.mark.slow
@pytest.mark.parametrize("stop_at", [3, 4])  # an epoch is 3 steps: off and on its boundary
def test_resume_across_epoch_boundaries_continues_the_data_order(stop_at, tmp_path, monkeypatch):
    text = tmp_path / "small.txt"
    text.write_text("".join(f"line {i:04d}: some words to read\n" for i in range(60)))
    over = {
        "data.source": str(text),
        "data.val_fraction": "0.1",
        "train.eval_every": "0",
        "model.dropout": "0.1",
        "train.log_every": "1",
    }  # a SIGTERM logs its partial interval
    train(_cfg(tmp_path / "straight", **over))
    _stop_after(monkeypatch, stop_at)
    train(_cfg(tmp_path / "resumed", **over))
    monkeypatch.undo()
    train(_cfg(tmp_path / "resumed", **{**over, "train.resume": "auto"}))
    assert _losses(tmp_path / "resumed") == _losses(tmp_path / "straight")
    a, b = _weights(tmp_path / "straight"), _weights(tmp_path / "resumed")
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_non_finite_weights_are_never_saved(tmp_path):
    from onegpu.backends.torch.backend import TorchBackend
    from onegpu.runs.backend import OneProcess
    from onegpu.runs.folder import RunFolder
    from onegpu.runs.saver import Saver

    backend = TorchBackend()
    cfg = backend.build(_cfg(tmp_path / "run"))
    run = RunFolder(tmp_path / "run", cfg)
    meter = backend.meter()
    saver = Saver(run, backend, cfg, OneProcess())
    assert saver.save(meter, wait=True) is not None  # finite: written
    with torch.no_grad():
        backend.built.model.blocks[0].mlp.fc.weight[0, 0] = float("inf")
    with pytest.warns(UserWarning, match="non-finite"):
        assert saver.save(meter, wait=True) is None
    with pytest.warns(UserWarning, match="non-finite"):
        saver.final_weights()
    assert not (tmp_path / "run" / "model.safetensors").exists()
    run.close()


@pytest.mark.slow  # four runs; test_host_offload moves checkpoints both ways in the default suite
def test_a_run_resumes_with_the_optimizer_moved_to_or_from_the_host(tmp_path, monkeypatch):
    """memory.offload_optimizer may change on resume: the states have one layout."""
    over = {"train.precision": "fp32", "train.micro_batch_size": "2"}
    train(_cfg(tmp_path / "straight", **over))
    for first, then in (("true", "false"), ("false", "true")):
        out = tmp_path / f"from-{first}"
        _stop_after(monkeypatch, 3)
        train(_cfg(out, **over, **{"memory.offload_optimizer": first}))
        monkeypatch.undo()
        train(_cfg(out, **over, **{"memory.offload_optimizer": then, "train.resume": "auto"}))
        assert _losses(out) == _losses(tmp_path / "straight")


@pytest.mark.slow  # moved from the fast run to keep it under 5 minutes
def test_a_second_signal_during_a_save_stops_at_once_in_one_line(tmp_path, monkeypatch, capsys):
    """Ctrl-C twice while a checkpoint is written: exit 130, one line, no traceback; the
    checkpoints written before load, the cut one left no file under a checkpoint's name, and
    `--train.resume auto` finishes the run. The handlers are compared with the ones in force
    when the test started: a shell that starts pytest in the background ignores SIGINT."""
    from onegpu.cli import main

    before = signal.getsignal(signal.SIGINT)
    real = checkpoints.write_atomic
    saves = {"n": 0}

    def interrupted_save(path, state):
        saves["n"] += 1
        if saves["n"] == 2:  # the user presses Ctrl-C twice during the second save
            os.kill(os.getpid(), signal.SIGINT)
            os.kill(os.getpid(), signal.SIGINT)
        real(path, state)

    monkeypatch.setattr(checkpoints, "write_atomic", interrupted_save)
    out = tmp_path / "run"
    args = ["train", "--preset", "tiny", "--train.device", "cpu", "--train.max_steps", "6",
            "--checkpoint.every", "1", "--train.measure_memory", "false", "--out.progress",
            "false", "--train.skip_memory_check", "true", "--out", str(out)]  # fmt: skip
    assert main(args) == 130
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("onegpu: stopped at once by a second SIGINT")
    assert not any("Traceback" in line or "KeyboardInterrupt" in line for line in err)
    assert signal.getsignal(signal.SIGINT) is before  # handlers put back
    kept = checkpoints.complete_checkpoints(out / "checkpoints")
    assert [s for s, _ in kept] == [1]
    monkeypatch.setattr(checkpoints, "write_atomic", real)
    assert main([*args, "--train.resume", "auto"]) == 0
    assert json.loads((out / "summary.json").read_text())["steps"] == 6


def _mapped(path: Path) -> bool:
    return str(path) in Path("/proc/self/maps").read_text()


@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="reads Linux's /proc/self/maps")
@pytest.mark.parametrize(
    "over",
    [{}, {"memory.offload_states": "true", "memory.loss_chunk": "0"}],
    ids=["read-for-the-optimizer", "copied-from-the-mapping"],
)
def test_a_resume_maps_the_checkpoint_and_lets_it_go_once_restored(over, tmp_path, monkeypatch):
    """The checkpoint is mapped, not read into memory (an 8B model's is 30 GB), and once the
    model and optimizer hold their copies nothing keeps it: not the file's pages, not a second
    copy of the weights for the rest of the run. On a CPU the weights and states are read
    into memory for the optimizer to adopt; where the states are parked in host memory
    (memory.offload_states) they are copied from the mapping, as on a GPU."""
    out = tmp_path / "run"
    train(_cfg(out, **over, **{"train.max_steps": "2"}))
    saved = out / "checkpoints" / ckpt.checkpoint_name(2)
    real, seen = ckpt.load_state, {}

    def load_state(built, previous):
        seen["mapped while loading"] = _mapped(saved)
        real(built, previous)
        seen["mapped once restored"] = _mapped(saved)
        seen["kept"] = {"model", "optimizer"} & set(previous.state)

    monkeypatch.setattr(ckpt, "load_state", load_state)
    train(_cfg(out, **over, **{"train.max_steps": "3", "train.resume": "auto"}))
    assert seen == {"mapped while loading": True, "mapped once restored": False, "kept": set()}
