"""The optimizers that need little memory, side by side: state bytes, loss after 200 steps,
tokens/s, on the `small` preset (6 x d256, byte-level; batch 8, bf16 autocast) on this CPU.

Each row is `onegpu train --preset small` for 200 steps in a fresh process (onegpu bench's row
runner: the median steady step, the measured step's breakdown), with the same data, seed,
learning rate and schedule; only the optimizer changes. State bytes: planned (`onegpu plan`)
and measured (the second step's optimizer states, counted exactly). GaLore and APOLLO run at
rank 64 (a quarter of the width, as the APOLLO paper's LLaMA runs; the small model's matrices
are 256 wide, its default ranks would project nothing); APOLLO-Mini at its rank 1.

    python benchmarks/small_state_optimizers.py [--steps 200]

Writes benchmarks/results/small-state-optimizers-<date>.md (a new file each run).
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
from records import bf16_kind, write_result

from onegpu.tools.bench import run_row

ROWS = {
    "adamw": {},
    "adamw8bit": {"optim.name": "adamw8bit"},
    "adamw4bit": {"optim.name": "adamw4bit"},
    "adafactor": {"optim.name": "adafactor"},
    "adam-mini": {"optim.name": "adam-mini"},
    "galore (rank 64)": {"optim.name": "galore", "optim.rank": "64"},
    "apollo (rank 64)": {"optim.name": "apollo", "optim.rank": "64"},
    "apollo-mini": {"optim.name": "apollo-mini"},
}
FIXED = {"train.precision": "bf16", "train.batch_size": "8", "train.micro_batch_size": "8",
         "train.eval_every": "0"}  # fmt: skip


def planned(over: dict[str, str]) -> dict:
    """`onegpu plan --json` of the row: its optimizer state bytes and the weights' count."""
    cmd = [sys.executable, "-m", "onegpu", "plan", "--preset", "small", "--json"]
    for k, v in {**FIXED, **over}.items():
        cmd += [f"--{k}", v]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    return json.loads(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--steps", type=int, default=200)
    args = ap.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as work:
        for name, over in ROWS.items():
            run = run_row("small", None, {**FIXED, **over}, args.steps, Path(work))
            rows.append((name, planned(over), run))
            print(f"{name}: loss {run['loss']:.4f}, {run['tokens_per_s']:,.0f} tok/s", flush=True)
    lines = [
        "# Optimizers that need little memory, on `small` (CPU)",
        "",
        f"Machine: {platform.processor() or platform.machine()}, bf16 kind: {bf16_kind()}, "
        f"{torch.get_num_threads()} threads, torch {torch.__version__}. bf16 autocast over fp32 "
        "weights (the low-rank methods and Adam-mini have no bf16-weight variant), batch 8 x "
        "256 tokens.",
        f"Command: `python benchmarks/small_state_optimizers.py --steps {args.steps}`.",
        "",
        "| optimizer | state bytes planned | measured | bytes/weight | loss after "
        f"{args.steps} steps | tokens/s |",
        "|---|---|---|---|---|---|",
    ]
    for name, plan, run in rows:
        measured = run["memory"]["optimizer"]
        lines.append(
            f"| {name} | {plan['memory']['optimizer']:,} | {measured:,} | "
            f"{measured / plan['params']:.2f} | "
            f"{run['loss']:.4f} | {run['tokens_per_s']:,.0f} |"
        )
    write_result("small-state-optimizers", lines)


if __name__ == "__main__":
    main()
