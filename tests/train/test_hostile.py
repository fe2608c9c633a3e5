"""What a hostile week of use did to runs, held: changed data under a resume, a damaged newest
checkpoint, a divergence that outlasts keep_last."""

import json

import pytest
import torch

from onegpu.backends.torch import checkpoint as ckpt
from onegpu.config import ConfigError, load_config
from onegpu.runs import checkpoints
from onegpu.train import train


def _cfg(out, **over):
    values = {"train.device": "cpu", "train.max_steps": "6", "train.log_every": "2",
              "train.eval_every": "0", "train.measure_memory": "false",
              "checkpoint.every": "2", "out.progress": "false", "out.dir": str(out), **over}  # fmt: skip
    return load_config("tiny", overrides=values)


def _text(tmp_path):
    src = tmp_path / "data.txt"
    src.write_text("".join(f"line {i}: the quick brown fox jumps over the lazy dog\n"
                           for i in range(400)))  # fmt: skip
    return src


def test_a_resume_on_changed_data_is_refused_unless_meant(tmp_path):
    src = _text(tmp_path)
    out = tmp_path / "run"
    train(_cfg(out, **{"data.source": str(src), "train.max_steps": "4"}))
    with src.open("a") as f:
        f.write("appended later: a few more words\n" * 50)
    more = {"data.source": str(src), "train.max_steps": "6", "train.resume": "auto"}
    with pytest.raises(ConfigError, match=r"^data.source: the data changed since the checkpoint"):
        train(_cfg(out, **more))
    s = train(_cfg(out, **more, **{"train.resume_new_data": "true"}))
    assert s["steps"] == 6


@pytest.mark.slow  # three runs
def test_resume_auto_skips_a_damaged_newest_checkpoint(tmp_path):
    straight = tmp_path / "straight"
    train(_cfg(straight, **{"train.max_steps": "8"}))
    out = tmp_path / "run"
    train(_cfg(out))
    newest = checkpoints.complete_checkpoints(out / "checkpoints")[-1][1]
    newest.write_bytes(newest.read_bytes()[: newest.stat().st_size // 3])  # a disk error
    with pytest.warns(UserWarning, match=r"skipping .*step-00000006"):
        s = train(_cfg(out, **{"train.max_steps": "8", "train.resume": "auto"}))
    assert s["steps"] == 8
    a = torch.load(out / "checkpoints" / ckpt.checkpoint_name(8), weights_only=True)["model"]
    b = torch.load(straight / "checkpoints" / ckpt.checkpoint_name(8), weights_only=True)["model"]
    assert all(torch.equal(a[k], b[k]) for k in a)  # from step 4, bit-exactly


def test_a_divergence_keeps_the_last_good_checkpoint_whatever_keep_last_says(tmp_path):
    out = tmp_path / "run"
    s = train(_cfg(out, **{"optim.lr": "1e6", "train.max_steps": "60", "checkpoint.keep_last": "1",
                           "train.max_consecutive_skips": "6"}))  # fmt: skip
    assert s["diverged"]
    good = s["last_good_checkpoint"]
    assert good is not None and (out / "checkpoints" / good.split("/")[-1]).exists()
    step = int(good.split("step-")[1].split(".")[0])
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert step <= s["steps"] - 6  # from before the run of skipped updates
    assert any(r.get("skipped_steps", 0) for r in rows)
    state = torch.load(good, weights_only=True)["model"]
    assert all(torch.isfinite(v).all() for v in state.values())
