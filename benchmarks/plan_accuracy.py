"""Planner accuracy: predicted step peak (fake tensors) against the measured one (real step).

For each configuration of the grid, `onegpu plan`'s prediction is compared with a real second
training step on this CPU, measured by the profiler's memory timeline (tensor bytes at the
step's peak: the figure `summary.json` reports). Saved-activation bytes are compared too (exact
on both sides). Each real step runs in a fresh process so that configurations do not share
allocator state. Target (issue 5): every prediction within 10% of the measurement.

Usage: python benchmarks/plan_accuracy.py [--out benchmarks/results]
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import time
from pathlib import Path

import torch

GRID: list[tuple[str, dict[str, str]]] = [
    ("tiny fp32", {"train.precision": "fp32"}),
    ("tiny bf16", {"train.precision": "bf16"}),
    ("small bf16", {"__preset": "small"}),
    ("small fp32 block", {"__preset": "small", "train.precision": "fp32", "memory.checkpointing": "block"}),
    ("small bf16 selective", {"__preset": "small", "memory.checkpointing": "selective"}),
    ("small bf16 attn+mlp accum x4", {"__preset": "small", "memory.checkpointing": "attn+mlp", "train.micro_batch_size": "4"}),
    ("small bf16-pure", {"__preset": "small", "train.precision": "bf16-pure"}),
    ("small seq 128 micro 32", {"__preset": "small", "data.seq_len": "128", "train.batch_size": "32", "train.micro_batch_size": "32"}),
    ("small adafactor", {"__preset": "small", "optim.name": "adafactor"}),
    ("small sgd 8 layers", {"__preset": "small", "optim.name": "sgd", "model.n_layer": "8"}),
    ("small adamw8bit", {"__preset": "small", "optim.name": "adamw8bit"}),
    ("seed-ref micro 4 fp32", {"__preset": "seed-ref", "train.precision": "fp32", "train.batch_size": "8", "train.micro_batch_size": "4", "memory.loss_chunk": "0"}),
    ("seed-ref micro 4 chunked", {"__preset": "seed-ref", "train.batch_size": "8", "train.micro_batch_size": "4", "memory.loss_chunk": "1024"}),
    ("seed-ref micro 8 bf16 block chunked", {"__preset": "seed-ref", "train.batch_size": "8", "train.micro_batch_size": "8", "memory.checkpointing": "block", "memory.loss_chunk": "2048"}),
]  # fmt: skip


def measure(preset: str, overrides: dict[str, str]) -> dict:
    """Run in a worker process: predicted and measured breakdowns for one configuration."""
    from onegpu.backends.torch.step_memory import measure_real_step
    from onegpu.config import load_config
    from onegpu.plan.memory import plan_memory

    cfg = load_config(preset, overrides={"train.device": "cpu", **overrides})
    plan = plan_memory(cfg)
    built, measured = measure_real_step(cfg)
    return {
        "predicted": plan.memory,
        "measured": {k: measured[k] for k in plan.memory},
        "saved_predicted": plan.saved_per_micro_batch,
        "saved_measured": measured["saved_activations_per_micro_batch"],
        "plan_seconds": plan.seconds,
        "precision": built.cfg.train.precision,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        over = json.loads(args.worker)
        preset = over.pop("__preset", "tiny")
        print(json.dumps(measure(preset, over)))
        return
    rows = []
    for name, over in GRID:
        proc = subprocess.run(
            [sys.executable, __file__, "--worker", json.dumps(over)], capture_output=True, text=True
        )
        if proc.returncode != 0:
            sys.exit(f"{name} failed:\n{proc.stderr[-3000:]}")
        r = json.loads(proc.stdout.strip().splitlines()[-1])
        r["name"], r["overrides"] = name, over
        r["error"] = r["predicted"]["peak"] / r["measured"]["peak"] - 1
        rows.append(r)
        print(f"{name}: predicted {r['predicted']['peak'] / 2**20:,.1f} MiB, measured "
              f"{r['measured']['peak'] / 2**20:,.1f} MiB ({r['error']:+.1%})", flush=True)  # fmt: skip
    mib = 2**20
    lines = [
        "# Planner accuracy: predicted vs measured step peak (CPU)",
        "",
        f"Prediction: `onegpu plan` (one step followed on fake tensors). Measurement: a real second "
        f"step, tensor bytes at its peak from the profiler's memory timeline, optimizer states "
        f"counted exactly. {platform.machine()}, torch {torch.__version__}, "
        f"{time.strftime('%Y-%m-%d')}.  ",
        "Command: `python benchmarks/plan_accuracy.py`",
        "",
        "| configuration | predicted peak | measured peak | error | saved/micro-batch predicted "
        "| measured | plan time |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['name']} | {r['predicted']['peak'] / mib:,.2f} MiB | "
            f"{r['measured']['peak'] / mib:,.2f} MiB | {r['error']:+.1%} | "
            f"{r['saved_predicted'] / mib:,.2f} MiB | {r['saved_measured'] / mib:,.2f} MiB | "
            f"{r['plan_seconds']:.1f} s |"
        )
    worst = max(abs(r["error"]) for r in rows)
    lines += ["", f"Largest error: {worst:.1%} over {len(rows)} configurations."]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "plan-accuracy.md").write_text("\n".join(lines) + "\n")
    (out / "plan-accuracy.json").write_text(json.dumps(rows, indent=1) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
