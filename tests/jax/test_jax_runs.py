"""A JAX run as a user starts it: torch-free, refusing what has no JAX counterpart in one line,
resumable bit for bit, and its weights exported by the torch tools."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

jax = pytest.importorskip("jax")

from onegpu.config import ConfigError, load_config  # noqa: E402

ARGS = ["--preset", "tiny", "--train.backend", "jax", "--train.precision", "fp32",
        "--out.progress", "false", "--train.log_every", "1", "--train.eval_every", "0"]  # fmt: skip

NO_TORCH = """
import sys
sys.modules["torch"] = None  # `import torch` anywhere now fails
from onegpu.cli import main
code = main(sys.argv[1:])
assert not any(m == "torch" or m.startswith("torch.") for m in sys.modules if sys.modules[m]), \\
    sorted(m for m in sys.modules if m.startswith("torch") and sys.modules[m])
sys.exit(code)
"""


def _run(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "ONEGPU_ALLOCATOR": "system", "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-c", NO_TORCH, "train", *ARGS, *args],
                          capture_output=True, text=True, timeout=300, env=env)  # fmt: skip


def _losses(out: Path) -> dict[int, float]:
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in rows if "loss" in r}


@pytest.mark.slow
def test_a_jax_run_imports_no_torch_and_writes_the_run_folder(tmp_path):
    out = tmp_path / "run"
    proc = _run("--train.max_steps", "3", "--out.dir", str(out), "--out.tensorboard", "true")
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["backend"] == "jax" and summary["steps"] == 3
    assert summary["xla_memory"]["argument_bytes"] > 0
    assert set(_losses(out)) == {1, 2, 3}
    # config.toml holds what ran, every auto decided (a resume continues it)
    import tomllib

    ran = tomllib.loads((out / "config.toml").read_text())
    assert ran["train"]["precision"] in ("fp32", "bf16")
    assert ran["memory"]["loss_chunk"] != "auto"
    assert ran["train"]["xla_flags"] == summary["xla_flags"]["setting"] == "none"  # 3 steps
    assert (out / "model.safetensors").is_file() and (
        out / "checkpoints" / "step-00000003.jax"
    ).is_file()
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(out / "tensorboard"))
    events.Reload()
    loss = [e.value for e in events.Scalars("train/loss")]
    assert loss == pytest.approx([_losses(out)[s] for s in (1, 2, 3)], rel=1e-6)


@pytest.mark.parametrize(
    ("key", "value"),
    [("memory.gelu_bits", "2"), ("optim.name", "adamw8bit"), ("memory.offload_params", "true"),
     ("train.compile", "default"), ("train.precision", "fp16")],
)  # fmt: skip
def test_what_has_no_jax_counterpart_is_refused_naming_the_field(key, value):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        load_config("tiny", overrides={"train.backend": "jax", key: value})


def test_scan_layers_is_refused_on_torch():
    with pytest.raises(ConfigError, match="model.scan_layers"):
        load_config("tiny", overrides={"model.scan_layers": "true"})


@pytest.mark.slow
def test_a_resumed_jax_run_continues_bit_for_bit(tmp_path):
    steps = ["--train.max_steps", "6", "--checkpoint.every", "3", "--model.scan_layers", "true",
             "--memory.checkpointing", "selective"]  # fmt: skip
    whole, cut = tmp_path / "whole", tmp_path / "cut"
    assert _run(*steps, "--out.dir", str(whole)).returncode == 0
    first = _run("--train.max_steps", "3", *steps[2:], "--out.dir", str(cut))
    assert first.returncode == 0, first.stderr[-2000:]
    again = _run(*steps, "--out.dir", str(cut), "--train.resume", "auto")
    assert again.returncode == 0, again.stderr[-2000:]
    assert _losses(cut) == _losses(whole)


@pytest.mark.slow
def test_the_torch_tools_read_a_jax_run(tmp_path):
    out = tmp_path / "run"
    assert _run("--train.max_steps", "2", "--out.dir", str(out)).returncode == 0
    export = subprocess.run([sys.executable, "-m", "onegpu", "export", str(out), "--out",
                             str(tmp_path / "hf")], capture_output=True, text=True, timeout=300)  # fmt: skip
    assert export.returncode == 0, export.stderr[-2000:]
    assert (tmp_path / "hf" / "model.safetensors").is_file()
    gen = subprocess.run([sys.executable, "-m", "onegpu", "generate", str(out), "--prompt", "def",
                          "--max-new-tokens", "12", "--temperature", "0"],
                         capture_output=True, text=True, timeout=300)  # fmt: skip
    assert gen.returncode == 0, gen.stderr[-2000:]
    assert gen.stdout.strip(), "no text generated"


@pytest.mark.slow  # 60 steps and their checkpoints: 12 s
def test_a_diverging_jax_run_skips_updates_and_keeps_the_last_good_checkpoint(tmp_path):
    from onegpu.backends.jax import checkpoint as state
    from onegpu.train import train

    out = tmp_path / "run"
    over = {"optim.lr": "1e3", "train.max_steps": "60", "checkpoint.keep_last": "1",
            "train.max_consecutive_skips": "6", "checkpoint.every": "2", "out.dir": str(out),
            "train.backend": "jax", "train.precision": "fp32", "out.progress": "false",
            "train.log_every": "1", "train.eval_every": "0"}  # fmt: skip
    s = train(load_config("tiny", overrides=over))
    assert s["diverged"] and s["skipped_steps"] >= 6
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert any(r.get("skipped_steps", 0) for r in rows)
    good = Path(s["last_good_checkpoint"])
    assert good.exists() and int(good.stem.split("-")[1]) <= s["steps"] - 6
    saved = state.read(good)
    leaves = jax.tree_util.tree_leaves(saved["params"])
    assert leaves and all(np.isfinite(np.asarray(v)).all() for v in leaves)
    assert not (out / "model.safetensors").exists()  # no non-finite weights exported


@pytest.mark.slow  # two JAX runs, each compiling its step
def test_a_jax_step_that_cannot_fit_is_refused_from_xlas_own_analysis(tmp_path, monkeypatch):
    """The JAX backend checks before its first step: XLA's memory analysis of the compiled
    step against the memory available now; refused in one line, nothing trained."""
    from onegpu.backends.jax import backend
    from onegpu.train import train

    monkeypatch.setattr(backend, "available_host_bytes", lambda: 1024)
    out = tmp_path / "run"
    over = {"train.backend": "jax", "out.dir": str(out), "out.progress": "false",
            "train.max_steps": "2"}  # fmt: skip
    with pytest.raises(ConfigError, match=r"^train.skip_memory_check: XLA plans .* GiB for one"):
        train(load_config("tiny", overrides=over))
    assert not out.exists()  # refused before the run folder was written
    s = train(load_config("tiny", overrides={**over, "train.skip_memory_check": "true"}))
    assert s["steps"] == 2
