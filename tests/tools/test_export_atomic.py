"""Exports are whole or absent: killed at random moments, the folder holds the old export or
the new one, never a mix; what they write generates with a cache and batches with a pad."""

import json
import random
import signal
import subprocess
import sys
import time

import pytest
import torch
import transformers
from safetensors.torch import load_file

from onegpu.config import load_config
from onegpu.runs.atomic import recover, staging
from onegpu.tools.export import export
from onegpu.train import train


def _run(out, layers: int):
    base = {"train.device": "cpu", "train.max_steps": "2", "train.eval_every": "0",
            "train.measure_memory": "false", "out.progress": "false", "out.dir": str(out),
            "model.n_layer": str(layers)}  # fmt: skip
    train(load_config("tiny", overrides=base))
    return out


def _which(folder, a, b) -> str:
    """'a' or 'b': which export `folder` holds, config and weights agreeing."""
    layers = json.loads((folder / "config.json").read_text())["n_layer"]
    weights = load_file(folder / "model.safetensors")
    for name, ref in (("a", a), ("b", b)):
        ref_layers = json.loads((ref / "config.json").read_text())["n_layer"]
        ref_weights = load_file(ref / "model.safetensors")
        if (
            layers == ref_layers
            and weights.keys() == ref_weights.keys()
            and all(torch.equal(weights[k], ref_weights[k]) for k in weights)
        ):
            return name
    raise AssertionError(f"{folder} holds a mix: {layers} layers, {len(weights)} tensors")


@pytest.mark.slow
def test_an_export_killed_at_any_moment_leaves_the_old_or_the_new(tmp_path):
    run_a, run_b = _run(tmp_path / "a", 2), _run(tmp_path / "b", 3)
    ref_a, ref_b = tmp_path / "ref-a", tmp_path / "ref-b"
    export(run_a, ref_a)
    export(run_b, ref_b)
    out = tmp_path / "out"
    export(run_a, out)
    rng = random.Random(0)
    seen = []
    for _ in range(6):
        proc = subprocess.Popen([sys.executable, "-m", "onegpu", "export", str(run_b), "--out",
                                 str(out), "--overwrite"], stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL)  # fmt: skip
        time.sleep(rng.uniform(0.5, 6.0))
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        recover(out)  # what the next export does first
        seen.append(_which(out, ref_a, ref_b))
        if seen[-1] == "b":
            export(run_a, out, overwrite=True)  # back to the old one for the next kill
    assert not list(tmp_path.glob(".onegpu-*"))  # nothing half-written left beside it
    print("kills landed on:", seen)


def test_a_failed_write_leaves_the_folder_untouched(tmp_path):
    dest = tmp_path / "dest"
    dest.mkdir()
    (dest / "a.txt").write_text("old")
    with pytest.raises(RuntimeError), staging(dest) as tmp:
        (tmp / "a.txt").write_text("new")
        raise RuntimeError("killed")
    assert (dest / "a.txt").read_text() == "old" and not list(tmp_path.glob(".onegpu-*"))
    with staging(dest) as tmp:
        (tmp / "a.txt").write_text("new")
    assert (dest / "a.txt").read_text() == "new" and not list(tmp_path.glob(".onegpu-*"))


def test_an_export_generates_with_its_cache_and_batches_with_a_pad_token(tmp_path):
    run = _run(tmp_path / "run", 2)
    export(run, tmp_path / "hf")
    gen = json.loads((tmp_path / "hf" / "generation_config.json").read_text())
    assert gen.get("use_cache", True) is True and gen["pad_token_id"] is not None
    tok = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf", local_files_only=True)
    assert tok.pad_token is not None
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    tok.padding_side = "left"
    batch = tok(["def f():", "x"], return_tensors="pt", padding=True)
    out = model.generate(**batch, max_new_tokens=4, do_sample=False)
    assert out.shape == (2, batch["input_ids"].shape[1] + 4)


def test_a_file_written_atomically_is_the_old_or_the_new_one(tmp_path):
    """What every writer of a kept file uses (run config, tokenizer, tune/bench/plot/profile
    results): a failure mid-write leaves the old file and no temporary one; the suffix is kept
    for writers that go by it (matplotlib's savefig)."""
    from onegpu.runs.atomic import atomic_path, write_text_atomic

    dest = tmp_path / "tune.md"
    write_text_atomic(dest, "old")
    with pytest.raises(KeyboardInterrupt), atomic_path(dest) as tmp:
        assert tmp.suffix == ".md" and tmp.parent == tmp_path
        tmp.write_text("half")
        raise KeyboardInterrupt
    assert dest.read_text() == "old" and sorted(p.name for p in tmp_path.iterdir()) == ["tune.md"]
    write_text_atomic(dest, "new")
    assert dest.read_text() == "new" and (dest.stat().st_mode & 0o777) != 0o600


@pytest.mark.slow  # moved from the fast run to keep it under 5 minutes
def test_plot_and_tune_results_are_written_through_the_atomic_writer(tmp_path, capsys):
    from onegpu.cli import main

    run = _run(tmp_path / "run", 2)
    assert main(["plot", str(run), "--out", str(tmp_path / "loss.png")]) == 0
    assert (tmp_path / "loss.png").read_bytes()[:4] == b"\x89PNG"
    assert not list(tmp_path.glob(".onegpu-*"))
