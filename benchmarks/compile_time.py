"""Compile time and step time: whole-model vs regional compile, at two depths.

Seed 000 scans over layers so that compile time does not grow with depth; `train.compile
regional` is PyTorch's counterpart (one block compiled, reused by every layer). Each run is a
fresh `onegpu train` process with an empty inductor cache (a cold compile, what a user sees
first), rounds interleaved, medians reported.

Usage: python benchmarks/compile_time.py [--layers 4,12] [--rounds 2] [--steps 10]
Writes benchmarks/results/compile-time.md and .json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

MODES = ("none", "default", "regional")


def run(layers: int, mode: str, steps: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "run"
        env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(Path(tmp) / "inductor")}
        cmd = [sys.executable, "-m", "onegpu", "train", "--out", str(out)]
        cmd += ["--model.n_layer", str(layers), "--train.compile", mode]
        cmd += ["--train.max_steps", str(steps), "--train.log_every", "1"]
        cmd += ["--train.eval_every", "0", "--train.measure_memory", "false"]
        cmd += ["--out.progress", "false", "--out.save_checkpoint", "false"]
        subprocess.run(cmd, check=True, capture_output=True, env=env)
        s = json.loads((out / "summary.json").read_text())
        rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    steady = statistics.median(r["step_time_s"] for r in rows[2:])
    return {
        "first_step_s": s["first_step_s"],
        "step_time_s": steady,
        "compile_time_s": max(0.0, s["first_step_s"] - steady),
        "tokens_per_s": s["tokens"] / s["steps"] / steady,
        "precision": s["precision"],
        "allocator": s.get("allocator"),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--layers", default="4,12")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--out", default="benchmarks/results")
    args = ap.parse_args()
    depths = [int(x) for x in args.layers.split(",")]
    runs: dict[str, list[dict]] = {f"{d}/{m}": [] for d in depths for m in MODES}
    for r in range(args.rounds):
        for key in runs:
            d, m = key.split("/")
            res = run(int(d), m, args.steps)
            runs[key].append(res)
            print(f"round {r + 1} {d} layers {m}: compile {res['compile_time_s']:.1f} s, "
                  f"step {res['step_time_s'] * 1e3:.0f} ms", flush=True)  # fmt: skip
    med = {k: {f: statistics.median(x[f] for x in v) for f in v[0] if f not in ("precision", "allocator")} for k, v in runs.items()}  # fmt: skip
    first = next(iter(runs.values()))[0]
    lines = [
        "# Compile time: whole model vs regional (one block, reused)",
        "",
        f"`small` preset (d256, seq 256, batch 16) at {args.layers} layers; {first['precision']}; "
        f"allocator {first['allocator']}; cold inductor cache per run; {args.rounds} interleaved "
        f"rounds, medians; {platform.machine()}, {torch.get_num_threads()} threads, torch "
        f"{torch.__version__}, {time.strftime('%Y-%m-%d')}.  ",
        f"Command: `python benchmarks/compile_time.py --layers {args.layers} --rounds {args.rounds} "
        f"--steps {args.steps}`",
        "",
        "| layers | compile | compile time | first step | steady step | tokens/s | x eager |",
        "|---|---|---|---|---|---|---|",
    ]
    for key, m in med.items():
        d, mode = key.split("/")
        eager = med[f"{d}/none"]["tokens_per_s"]
        comp = "" if mode == "none" else f"{m['compile_time_s']:.1f} s"
        lines.append(
            f"| {d} | {mode} | {comp} | {m['first_step_s']:.1f} s | {m['step_time_s'] * 1e3:.0f} ms "
            f"| {m['tokens_per_s']:,.0f} | {m['tokens_per_s'] / eager:.2f} |"
        )
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "compile-time.md").write_text("\n".join(lines) + "\n")
    (out / "compile-time.json").write_text(json.dumps({"runs": runs, "median": med}, indent=1))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
