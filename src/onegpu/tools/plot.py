"""`onegpu plot RUN_DIR... --out loss.png`: training and validation loss against optimizer steps
and against tokens seen, one colour per run, so that runs compare at a glance (runs with
different batch sizes line up on the tokens axis)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from onegpu.config import ConfigError
from onegpu.runs.atomic import atomic_path

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib


def read_run(run: Path) -> dict:
    """A run's logged losses and its tokens per step."""
    metrics = run / "metrics.jsonl"
    if not metrics.is_file():
        raise ConfigError("RUN_DIR", f"{run} has no metrics.jsonl; is it a run folder?")
    train, val = [], []
    for line in metrics.read_text().splitlines():
        try:
            row = json.loads(line)
        except ValueError:
            break  # a line cut short by a kill
        if row.get("loss") is not None:
            train.append((row["step"], row["loss"]))
        if row.get("val_loss") is not None:
            val.append((row["step"], row["val_loss"]))
    tokens_per_step = 0
    try:
        cfg = tomllib.loads((run / "config.toml").read_text())
        seq = cfg["data"].get("seq_len") or cfg["model"]["seq_len"]
        tokens_per_step = int(cfg["train"]["batch_size"]) * int(seq)
    except (OSError, KeyError, ValueError, tomllib.TOMLDecodeError):
        pass  # no tokens axis for this run
    return {"name": run.name, "train": train, "val": val, "tokens_per_step": tokens_per_step}


def plot_runs(run_dirs: list[str], out: str | Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = [read_run(Path(r).expanduser()) for r in run_dirs]
    fig, (by_step, by_tokens) = plt.subplots(1, 2, figsize=(12, 4.5))
    for i, run in enumerate(runs):
        color = f"C{i % 10}"
        for rows, style, label in ((run["train"], "-", "train"), (run["val"], "o--", "val")):
            if not rows:
                continue
            steps, losses = zip(*rows, strict=True)
            name = f"{run['name']} {label}"
            by_step.plot(steps, losses, style, color=color, label=name, markersize=3)
            if run["tokens_per_step"]:
                tokens = [s * run["tokens_per_step"] for s in steps]
                by_tokens.plot(tokens, losses, style, color=color, label=name, markersize=3)
    by_step.set(xlabel="optimizer step", ylabel="loss", title="loss against steps")
    by_tokens.set(xlabel="tokens seen", ylabel="loss", title="loss against tokens")
    for ax in (by_step, by_tokens):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    out = Path(out).expanduser()
    out.parent.mkdir(parents=True, exist_ok=True)
    with atomic_path(Path(out)) as tmp:
        fig.savefig(tmp, dpi=110)
    plt.close(fig)
    return out
