"""The run lifecycle is one for both backends (runs/lifecycle.py): every test here runs on torch
and on JAX. Signals, bit-exact resume, a damaged newest checkpoint, changed data, a killed
save's leftovers, a second writer, kill -9 during saves, and a run that never touches another
backend's run."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from onegpu.config import ConfigError, load_config, to_dict
from onegpu.runs import checkpoints
from onegpu.runs.meter import Meter
from onegpu.train import train

BACKENDS = ["torch", "jax"]
SUFFIX = {"torch": ".pt", "jax": ".jax"}
OTHER = {"torch": "jax", "jax": "torch"}


def _cfg(out, backend, **over):
    values = {"train.backend": backend, "train.precision": "fp32", "train.compile": "none",
              "train.max_steps": "8", "train.log_every": "2", "train.eval_every": "4",
              "train.measure_memory": "false", "checkpoint.every": "2", "out.progress": "false",
              "optim.warmup_steps": "2",
              "out.dir": str(out), **over}  # fmt: skip
    return load_config("tiny", overrides=values)


def _stop_after(monkeypatch, n: int, sig=signal.SIGTERM):
    """Send this process `sig` after the n-th step's accounting (as a scheduler would), once:
    the same moment on both backends."""
    real = Meter.add
    calls = {"n": 0}

    def add(self, *args, **kwargs):
        real(self, *args, **kwargs)
        calls["n"] += 1
        if calls["n"] == n:
            os.kill(os.getpid(), sig)

    monkeypatch.setattr(Meter, "add", add)


def _rows(out):
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [(r["step"], r.get("loss"), r.get("val_loss"), r.get("grad_norm")) for r in rows]


def _weights(out):
    from safetensors.numpy import load_file

    return load_file(out / "model.safetensors")


def _same_weights(a, b):
    wa, wb = _weights(a), _weights(b)
    assert wa.keys() == wb.keys()
    for k in wa:
        assert np.array_equal(wa[k], wb[k]), k


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    """An uninterrupted 8-step run per backend: what every resumed run must equal."""
    runs = {}
    for backend in BACKENDS:
        out = tmp_path_factory.mktemp("straight") / backend
        train(_cfg(out, backend))
        runs[backend] = out
    return runs


@pytest.mark.slow  # several runs per backend (tests/train keeps torch's in the fast suite)
@pytest.mark.parametrize("backend", BACKENDS)
def test_a_signal_saves_and_the_resumed_run_is_the_straight_one(
    backend, straight, tmp_path, monkeypatch
):
    out = tmp_path / "run"
    every3 = {"checkpoint.every": "3"}
    _stop_after(monkeypatch, 4)  # off the checkpoint cadence: the stop saves step 4 itself
    s = train(_cfg(out, backend, **every3))
    assert s["interrupted"] and s["signal"] == "SIGTERM" and s["steps"] == 4
    assert s["backend"] == backend
    found = checkpoints.complete_checkpoints(out / "checkpoints")
    assert [step for step, _ in found] == [3, 4]
    assert all(p.name.endswith(SUFFIX[backend]) for _, p in found)
    assert not (out / "model.safetensors").exists()  # unfinished: no final weights
    monkeypatch.undo()
    s = train(_cfg(out, backend, **every3, **{"train.resume": "auto"}))
    assert s["steps"] == 8 and not s["interrupted"]
    assert _rows(out) == _rows(straight[backend])
    _same_weights(out, straight[backend])


@pytest.mark.slow  # several runs per backend (tests/train keeps torch's in the fast suite)
@pytest.mark.parametrize("backend", BACKENDS)
def test_resume_auto_skips_a_damaged_newest_checkpoint(backend, straight, tmp_path):
    out = tmp_path / "run"
    train(_cfg(out, backend))
    newest = checkpoints.complete_checkpoints(out / "checkpoints")[-1][1]
    assert newest.name == f"step-00000008{SUFFIX[backend]}"
    newest.write_bytes(newest.read_bytes()[: newest.stat().st_size // 3])  # a disk error
    with pytest.warns(UserWarning, match=r"skipping .*step-00000008"):
        s = train(_cfg(out, backend, **{"train.resume": "auto"}))
    assert s["steps"] == 8
    _same_weights(out, straight[backend])  # steps 7 and 8 again from step 6, bit for bit


@pytest.mark.slow  # several runs per backend (tests/train keeps torch's in the fast suite)
@pytest.mark.parametrize("backend", BACKENDS)
def test_a_resume_on_changed_data_or_trajectory_is_refused(backend, tmp_path):
    src = tmp_path / "data.txt"
    src.write_text("".join(f"line {i}: the quick brown fox jumps over the lazy dog\n"
                           for i in range(400)))  # fmt: skip
    out = tmp_path / "run"
    train(_cfg(out, backend, **{"data.source": str(src), "train.max_steps": "4"}))
    with src.open("a") as f:
        f.write("appended later: a few more words\n" * 50)
    more = {"data.source": str(src), "train.resume": "auto"}
    with pytest.raises(ConfigError, match=r"^data.source: the data changed since the checkpoint"):
        train(_cfg(out, backend, **more))
    with pytest.raises(ConfigError, match=r"^optim.lr: the checkpoint was trained with"):
        train(_cfg(out, backend, **more, **{"optim.lr": "0.5", "train.resume_new_data": "true"}))
    s = train(_cfg(out, backend, **more, **{"train.resume_new_data": "true"}))
    assert s["steps"] == 8


@pytest.mark.slow  # a run per backend (tests/train keeps torch's in the fast suite)
@pytest.mark.parametrize("backend", BACKENDS)
def test_leftovers_of_a_killed_save_are_removed_and_never_loaded(backend, tmp_path):
    out = tmp_path / "run"
    train(_cfg(out, backend, **{"train.max_steps": "4"}))
    folder = out / "checkpoints"
    cut = folder / f"{checkpoints.TMP_PREFIX}step-00000006{SUFFIX[backend]}.123"
    cut.write_bytes(b"half a checkpoint")  # what kill -9 in the middle of a save leaves
    s = train(_cfg(out, backend, **{"train.max_steps": "6", "train.resume": "auto"}))
    assert s["steps"] == 6 and not cut.exists()
    assert [p.name.startswith(".") for p in folder.iterdir()] == [False] * 3


@pytest.mark.slow  # a run per backend (tests/train keeps torch's in the fast suite)
@pytest.mark.parametrize("backend", BACKENDS)
def test_keep_last_and_keep_every_prune_the_same_way(backend, tmp_path):
    out = tmp_path / "run"
    over = {"checkpoint.every": "1", "checkpoint.keep_last": "2", "checkpoint.keep_every": "3"}
    train(_cfg(out, backend, **over))
    found = checkpoints.complete_checkpoints(out / "checkpoints")
    assert [s for s, _ in found] == [3, 6, 7, 8]


def _files(out: Path) -> dict[str, int]:
    """Every file of a run folder and when it was last written (the lock file aside)."""
    return {str(p): p.stat().st_mtime_ns for p in out.rglob("*") if p.is_file()
            if p.name != ".onegpu.lock"}  # fmt: skip


@pytest.mark.slow  # each case trains on both backends
@pytest.mark.parametrize("backend", BACKENDS)
def test_a_run_never_touches_another_backends_run(backend, tmp_path):
    """A resume into a folder another backend wrote is refused in one line naming that backend
    and the way across; its checkpoints and weights are left as they were."""
    out = tmp_path / "run"
    other = OTHER[backend]
    train(_cfg(out, other, **{"train.max_steps": "4"}))
    before = _files(out)
    with pytest.raises(ConfigError) as e:
        train(_cfg(out, backend, **{"train.resume": "auto"}))
    message = str(e.value)
    assert e.value.field_name == "train.resume"
    assert f"holds a {other} run" in message and "--model.init_from" in message
    assert str(out / "model.safetensors") in message
    foreign = checkpoints.complete_checkpoints(out / "checkpoints")[-1][1]
    with pytest.raises(ConfigError, match=f"is a {other} checkpoint"):
        train(_cfg(tmp_path / "new", backend, **{"train.resume": str(foreign)}))
    assert _files(out) == before
    # the way across works: the other backend's final weights start this backend's run
    s = train(_cfg(tmp_path / "across", backend, **{"model.init_from": str(out / "model.safetensors"),
                                                    "train.max_steps": "2"}))  # fmt: skip
    assert s["steps"] == 2


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_second_writer_is_refused_naming_the_holder(backend, tmp_path):
    run = tmp_path / "run"
    claim = ("import sys; from onegpu.runs.lock import hold_run_folder; from pathlib import Path; "
             "hold_run_folder(Path(sys.argv[1])); print('held', flush=True); sys.stdin.read()")  # fmt: skip
    holder = subprocess.Popen([sys.executable, "-c", claim, str(run)], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)  # fmt: skip
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(ConfigError, match=f"PID {holder.pid}"):
            train(_cfg(run, backend))
        assert [p.name for p in run.iterdir()] == [".onegpu.lock"]  # nothing written
    finally:
        holder.stdin.close()
        holder.wait()


def test_a_resumed_auto_keeps_what_the_checkpoints_run_decided(tmp_path):
    """`train.compile auto` decides by the run's length: a resume with a shorter max_steps would
    decide eager where the checkpoint compiled, and be refused as another run. An `auto` on
    resume takes the checkpoint's decision; a value the user sets is checked as it is."""
    saved = to_dict(_cfg(tmp_path, "torch", **{"train.compile": "default"}))
    saved["train"]["precision"] = "bf16"
    resumed = _cfg(tmp_path, "torch", **{"train.compile": "auto", "train.precision": "auto"})
    kept = checkpoints.keep_decisions(saved, resumed)
    assert (kept.train.compile, kept.train.precision) == ("default", "bf16")
    assert (resumed.train.compile, resumed.train.precision) == ("auto", "auto")  # untouched
    checkpoints.check_same_run(saved, kept)
    eager = _cfg(tmp_path, "torch", **{"train.precision": "auto"})  # compile none, set
    with pytest.raises(ConfigError, match="train.compile"):
        checkpoints.check_same_run(saved, checkpoints.keep_decisions(saved, eager))
    assert checkpoints.keep_decisions(None, resumed) is resumed


@pytest.mark.slow  # moved from the fast run to keep it under 5 minutes
def test_a_resume_with_auto_continues_what_the_run_decided(tmp_path):
    """Through the lifecycle: a run with attention 'math' (which `auto` never picks on a CPU)
    resumed with attention `auto` continues with math, where deciding afresh would refuse the
    resume as another run."""
    out = tmp_path / "run"
    first = _cfg(out, "torch", **{"model.attention": "math", "train.max_steps": "2"})
    train(first)
    resumed = _cfg(out, "torch", **{"train.max_steps": "4", "train.resume": "auto"})
    assert resumed.model.attention == "auto"
    summary = train(resumed)
    assert summary["steps"] == 4 and summary["config"]["model"]["attention"] == "math"


def _cli(out, backend, *args):
    cmd = [sys.executable, "-m", "onegpu", "train", "--preset", "tiny", "--train.backend",
           backend, "--train.precision", "fp32", "--out.progress", "false",
           "--train.eval_every", "0", "--train.log_every", "1000", "--out", str(out), *args]  # fmt: skip
    if backend == "jax":  # a long run would time XLA's settings first (xla_flags auto)
        cmd += ["--train.xla_flags", "none"]
    else:  # and torch's compile modes and GELU kernel
        cmd += ["--train.compile", "none", "--train.gelu_kernel", "eager"]
    env = {**os.environ, "ONEGPU_ALLOCATOR": "system"}
    return subprocess.Popen(cmd, env=env, stderr=subprocess.PIPE, stdout=subprocess.PIPE,
                            text=True, start_new_session=True)  # fmt: skip


def _wait_for_checkpoint(out: Path, timeout: float = 180) -> None:
    deadline = time.time() + timeout
    while not checkpoints.complete_checkpoints(out / "checkpoints"):
        assert time.time() < deadline, "no checkpoint written"
        time.sleep(0.1)


@pytest.mark.slow
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(("sig", "code"), [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_a_signal_to_the_command_checkpoints_and_exits_128_plus_its_number(
    backend, sig, code, tmp_path
):
    out = tmp_path / "run"
    proc = _cli(out, backend, "--train.max_steps", "100000", "--checkpoint.every", "1000")
    (out / "metrics.jsonl").parent.mkdir(exist_ok=True)
    deadline = time.time() + 180
    while not (out / "metrics.jsonl").exists() and time.time() < deadline:
        time.sleep(0.2)  # the run folder is opened once the run is built
    time.sleep(1.0)
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=180)
    assert proc.returncode == code, err
    summary = json.loads((out / "summary.json").read_text())
    assert summary["interrupted"] and summary["signal"] == sig.name and summary["steps"] > 0
    found = checkpoints.complete_checkpoints(out / "checkpoints")
    assert [s for s, _ in found] == [summary["steps"]]
    assert "--train.resume auto" in err


@pytest.mark.slow
@pytest.mark.parametrize("backend", BACKENDS)
def test_kill_9_during_saves_loses_nothing_that_was_saved(backend, tmp_path):
    """A checkpoint every step, the process killed with SIGKILL at random moments (in a save
    most of the time), resumed each time: every resume starts from a complete checkpoint and
    the run finishes."""
    out = tmp_path / "run"
    rng = np.random.default_rng(0)
    args = ("--train.max_steps", "100000", "--checkpoint.every", "1", "--checkpoint.keep_last", "2")
    for attempt in range(3):
        proc = _cli(out, backend, *args, *(("--train.resume", "auto") if attempt else ()))
        _wait_for_checkpoint(out)
        time.sleep(float(rng.uniform(0.2, 1.5)))
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate(timeout=60)
        found = checkpoints.complete_checkpoints(out / "checkpoints")
        assert found, "a killed run lost its checkpoints"
        assert all(checkpoints.written_by(p) == backend for _, p in found)
    last = checkpoints.complete_checkpoints(out / "checkpoints")[-1][0]
    proc = _cli(out, backend, "--train.max_steps", str(last + 2), "--checkpoint.every", "1",
                "--train.resume", "auto")  # fmt: skip
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == last + 2 and summary["backend"] == backend
    assert not [p for p in (out / "checkpoints").iterdir() if p.name.startswith(".")]


@pytest.mark.slow  # 60 steps per backend
@pytest.mark.parametrize("backend", BACKENDS)
def test_a_divergence_keeps_the_last_good_checkpoint_whatever_keep_last_says(backend, tmp_path):
    out = tmp_path / "run"
    over = {"optim.lr": "1e3", "train.max_steps": "60", "checkpoint.keep_last": "1",
            "train.max_consecutive_skips": "6", "train.eval_every": "0"}  # fmt: skip
    s = train(_cfg(out, backend, **over))
    assert s["diverged"] and s["skipped_steps"] >= 6
    good = Path(s["last_good_checkpoint"])
    assert good.exists() and checkpoints.written_by(good) == backend
    assert int(good.name.split("-")[1].split(".")[0]) <= s["steps"] - 6
    assert not (out / "model.safetensors").exists()  # never non-finite weights


@pytest.mark.slow  # a run per backend
@pytest.mark.parametrize("backend", BACKENDS)
def test_a_full_disk_during_a_save_is_one_line_and_leaves_no_partial_file(
    backend, tmp_path, monkeypatch, capsys
):
    """The disk fills while a checkpoint is written: exit 1, one line with the disk's error and
    the resume advice (a resume can fix it), no half file under any name."""
    import errno

    from onegpu.cli import main

    real = checkpoints.write_atomic

    def full(path, write):
        def half(f):
            f.write(b"the first bytes of a checkpoint")
            raise OSError(errno.ENOSPC, "No space left on device")

        real(path, half)

    monkeypatch.setattr(checkpoints, "write_atomic", full)
    out = tmp_path / "run"
    code = main(["train", "--preset", "tiny", "--train.backend", backend, "--train.precision",
                 "fp32", "--train.max_steps", "2", "--checkpoint.every", "1", "--out.progress",
                 "false", "--train.eval_every", "0", "--optim.warmup_steps", "1",
                 "--out.dir", str(out)])  # fmt: skip
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 1 and len(err) == 1, err
    assert "No space left on device" in err[0] and "--train.resume auto" in err[0]
    assert os.listdir(out / "checkpoints") == []
