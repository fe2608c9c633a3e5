"""Files the machine wrote that came back wrong: a cache holding valid JSON of another shape is
measured again rather than crashing; a cache folder that cannot be made is one line naming
ONEGPU_CACHE, exit 2; a full disk during a save is one line, exit 1, with nothing half-written
left, and the advice to resume comes only where a resume continues the run."""

import errno
import json
import os

import pytest
import torch

from onegpu import cache
from onegpu.backends.torch import checkpoint as ckpt
from onegpu.cli import main
from onegpu.runs import checkpoints


def test_a_cache_of_the_wrong_shape_is_measured_again(tmp_path, monkeypatch):
    monkeypatch.setenv("ONEGPU_CACHE", str(tmp_path))
    (tmp_path / "odd.json").write_text("[1, 2, 3]")  # valid JSON, not an object
    assert cache.entries("odd.json") == {}
    (tmp_path / "odd.json").write_text(json.dumps({"k": 3, "j": {"flops": "x"}}))
    valid = cache.has("flops")
    assert cache.cached("odd.json", "k", lambda: {"flops": 1.0}, valid=valid) == {"flops": 1.0}
    assert cache.peek("odd.json", "j", valid=valid) is None
    assert cache.peek("odd.json", "k", valid=valid) == {"flops": 1.0}  # stored this time


@pytest.mark.slow  # measures this CPU afresh
def test_plan_survives_a_cache_file_of_another_shape(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("ONEGPU_CACHE", str(tmp_path))
    for name in ("cpu-peaks.json", "host-step.json", "attention.json", "loss_chunk.json"):
        (tmp_path / name).write_text('{"anything": 3, "else": [1]}')
    (tmp_path / "compile.json").write_text("3")
    assert main(["plan", "--preset", "tiny", "--memory.offload_optimizer", "true"]) == 0


@pytest.mark.slow  # a real tiny run
def test_a_full_disk_during_a_save_is_one_line_exit_1_and_leaves_no_partial_file(
    tmp_path, monkeypatch, capsys
):
    real_save = torch.save

    def full(obj, f, *args, **kwargs):
        real_save(obj, f, *args, **kwargs)
        raise OSError(28, "No space left on device", getattr(f, "name", str(f)))

    monkeypatch.setattr(ckpt.torch, "save", full)
    run = tmp_path / "run"
    code = main(["train", "--preset", "tiny", "--train.device", "cpu", "--train.max_steps", "2",
                 "--checkpoint.every", "1", "--out.progress", "false", "--optim.warmup_steps", "0",
                 "--out.dir", str(run)])  # fmt: skip
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 1 and len(err) == 1 and "No space left on device" in err[0], err
    assert "--train.resume auto" in err[0]
    assert not [
        p for p in (run / "checkpoints").iterdir() if p.name.startswith(checkpoints.TMP_PREFIX)
    ]
    assert os.listdir(run / "checkpoints") == []


TINY = ["train", "--preset", "tiny", "--train.device", "cpu", "--train.max_steps", "2",
        "--out.progress", "false", "--optim.warmup_steps", "0"]  # fmt: skip


def test_a_cache_folder_that_cannot_be_made_is_one_line_naming_onegpu_cache(
    tmp_path, monkeypatch, capsys
):
    """ONEGPU_CACHE under a regular file: the user's setting to fix (exit 2), not a machine
    failure with advice to resume a run that never started."""
    (tmp_path / "a-file").write_text("x")
    monkeypatch.setenv("ONEGPU_CACHE", str(tmp_path / "a-file" / "cache"))
    code = main([*TINY, "--out", str(tmp_path / "run")])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1, err
    assert err[0].startswith("onegpu: error: ONEGPU_CACHE: cannot write"), err[0]
    assert "set ONEGPU_CACHE to a writable folder" in err[0] and "resume" not in err[0]
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize(
    "in_run_folder",
    [
        pytest.param(True, id="run-folder", marks=pytest.mark.slow),
        pytest.param(False, id="elsewhere"),
    ],
)
def test_the_resume_advice_comes_only_for_a_write_of_the_run_folder(
    tmp_path, monkeypatch, capsys, in_run_folder
):
    """A full disk while training writes its run folder: resuming continues the run. The same
    error on any other file (the data, a cache, another command's output) is no such case."""
    from onegpu.runs import lifecycle

    run = tmp_path / "run"
    name = str(run / "metrics.jsonl") if in_run_folder else str(tmp_path / "elsewhere.bin")

    def full_disk(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device", name)

    monkeypatch.setattr(lifecycle, "_loop", full_disk)
    code = main([*TINY, "--train.skip_memory_check", "true", "--out", str(run)])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 1 and len(err) == 1, err
    assert err[0].startswith(f"onegpu: error: {name}: No space left on device"), err[0]
    assert ("--train.resume auto" in err[0]) == in_run_folder, err[0]
