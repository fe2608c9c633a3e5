"""One writer per run folder: a second run into a folder in use exits 2 naming the holder; a
lock left by a dead run is taken over; a refused run leaves nothing behind."""

import os
import subprocess
import sys

import pytest

from onegpu.config import ConfigError
from onegpu.runs.lock import LOCK_NAME, hold_run_folder, release_run_folder

CLAIM = "import sys; from onegpu.runs.lock import hold_run_folder; from pathlib import Path; " \
        "hold_run_folder(Path(sys.argv[1])); print('held', flush=True); sys.stdin.read()"  # fmt: skip


def test_a_folder_in_use_is_refused_naming_its_holder(tmp_path):
    run = tmp_path / "run"
    holder = subprocess.Popen([sys.executable, "-c", CLAIM, str(run)], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)  # fmt: skip
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(ConfigError, match=f"PID {holder.pid}") as e:
            hold_run_folder(run)
        assert e.value.field_name == "out.dir"
        out = subprocess.run([sys.executable, "-m", "onegpu", "train", "--preset", "tiny",
                              "--train.max_steps", "1", "--out.dir", str(run)],
                             capture_output=True, text=True)  # fmt: skip
        assert out.returncode == 2 and f"PID {holder.pid}" in out.stderr
        assert "Traceback" not in out.stderr
        assert sorted(p.name for p in run.iterdir()) == [LOCK_NAME]  # nothing written
    finally:
        holder.stdin.close()
        holder.wait()


def test_a_lock_left_by_a_dead_run_is_taken_over(tmp_path):
    run = tmp_path / "run"
    dead = subprocess.run([sys.executable, "-c", CLAIM, str(run)], input="", text=True,
                          capture_output=True)  # fmt: skip
    assert dead.returncode == 0 and (run / LOCK_NAME).exists()  # its lock file stays behind
    hold_run_folder(run)
    assert (run / LOCK_NAME).read_text().strip() == str(os.getpid())
    release_run_folder(run)


def test_a_run_refused_after_its_folder_check_leaves_no_folder_behind(tmp_path, monkeypatch):
    """The lock makes the folder; a refusal before the run is written (here the build's)
    takes both away again."""
    from onegpu.backends.torch import backend
    from onegpu.cli import main

    def refuse(*args, **kwargs):
        raise ConfigError("model.attention", "refused by the build")

    monkeypatch.setattr(backend, "build", refuse)
    run = tmp_path / "new-run"
    assert main(["train", "--preset", "tiny", "--out.dir", str(run)]) == 2
    assert not run.exists()
    existing = tmp_path / "old-run"
    existing.mkdir()
    (existing / "keep.txt").write_text("x")
    assert main(["train", "--preset", "tiny", "--out.dir", str(existing),
                 "--out.overwrite", "true"]) == 2  # fmt: skip
    assert [p.name for p in existing.iterdir()] == ["keep.txt"]
