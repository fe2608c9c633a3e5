"""`onegpu tune`'s results: the measured Pareto frontier (peak memory against tokens/s) as table,
plot and JSON, and the winner as best.toml."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from onegpu.config import (
    Config,
    to_toml,
)
from onegpu.runs.atomic import write_together


def write_results(result: dict[str, Any], best_cfg: Config, out_dir: Path) -> None:
    """best.toml, tune.json, tune.md and tune.png in `out_dir`."""
    trials, frontier, budget = result["trials"], result["frontier"], result["budget_bytes"]
    write_together(
        out_dir,
        {
            "best.toml": to_toml(best_cfg),
            "tune.json": json.dumps(result, indent=1) + "\n",
            "tune.md": frontier_table(result),
            "tune.png": lambda path: plot(trials, frontier, budget, path),
        },
    )


def size_text(nbytes: int) -> str:
    return f"{nbytes / 2**30:.2f} GiB" if nbytes >= 2**30 else f"{nbytes / 2**20:,.1f} MiB"


def trial_label(change: dict[str, str]) -> str:
    short = {
        "train.micro_batch_size": "micro",
        "memory.checkpointing": "remat",
        "train.precision": "",
        "optim.name": "",
        "memory.loss_chunk": "chunk",
        "memory.offload_activations": "activations on host",
        "memory.offload_optimizer": "optimizer on host",
        "memory.offload_states": "states on host",
        "memory.offload_params": "weights on host",
        "train.compile": "compile",
        "dist.strategy": "",
        "dist.cpu_offload": "shards on host",
        "dist.dp_replicate": "replicas",
        "dist.dp_shard": "shards",
        "dist.tp": "tp",
        "dist.pp": "pp",
    }
    mesh = ("dist.dp_replicate", "dist.dp_shard", "dist.tp", "dist.pp")
    parts = []
    for k, v in change.items():
        if v in ("0", "false", "none") and k != "memory.checkpointing":
            continue
        if k in mesh and v == "1":
            continue
        parts.append(short[k] if v == "true" else f"{short[k]} {v}".strip())
    return ", ".join(parts)


def pareto(trials: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Trials no other trial beats on both memory (lower) and tokens/s (higher)."""
    front = []
    for t in sorted(trials, key=lambda r: (r["peak_mem_bytes"], -r["tokens_per_s"])):
        if not front or t["tokens_per_s"] > front[-1]["tokens_per_s"]:
            front.append(t)
    return front


def frontier_table(result: dict[str, Any]) -> str:
    n = result.get("world_size", 1)
    per = f" per process of {n} (torchrun)" if n > 1 else ""
    lines = [
        f"# onegpu tune: budget {size_text(result['budget_bytes'])}{per}",
        "",
        f"{result['candidates']} candidates; {result['planned']} planned (largest micro-batch "
        f"first); {result['fitting']} fit with their largest micro-batch; "
        f"{len(result['trials'])} measured, cheapest-looking first. Pareto frontier (memory vs speed):",
        "",
        "| configuration | tokens/s | measured peak | planned peak |",
        "|---|---|---|---|",
    ]
    for t in result["frontier"]:
        lines.append(
            f"| {trial_label(t['change'])} | {t['tokens_per_s']:,.0f} | "
            f"{t['peak_mem_bytes'] / 2**20:,.0f} MiB | {t['planned_peak_bytes'] / 2**20:,.0f} MiB |"
        )
    best = result["best"]
    kind = best.get("peak_mem_kind")
    trained = best.get("trained_tokens_per_s")
    lines += [
        "",
        f"Measured peak: {kind}." if kind else "",
        f"Trained tokens (the loss's, without masked prompts and padding): {trained:,.0f}/s of "
        f"the fastest's {best['tokens_per_s']:,.0f} tokens/s."
        if trained and trained < 0.999 * best["tokens_per_s"]
        else "",
        f"Fastest that fits: {trial_label(result['best']['change'])} (best.toml).",
        "",
    ]
    return "\n".join(lines)


def plot(trials, frontier, budget: int, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5), dpi=100)
    ax.scatter(
        [t["peak_mem_bytes"] / 2**20 for t in trials],
        [t["tokens_per_s"] for t in trials],
        color="tab:gray",
        label="measured trials",
    )
    ax.plot(
        [t["peak_mem_bytes"] / 2**20 for t in frontier],
        [t["tokens_per_s"] for t in frontier],
        "o-",
        color="tab:blue",
        label="Pareto frontier",
    )
    ax.axvline(budget / 2**20, color="tab:red", ls="--", label="budget")
    ax.set_xlabel("peak memory of a step, MiB")
    ax.set_ylabel("tokens/s")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, format="png")
    plt.close(fig)
