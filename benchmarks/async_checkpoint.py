"""What a sharded checkpoint costs the loop, written during the step or in the background.

    python benchmarks/async_checkpoint.py [--preset small] [--steps 12] [--every 2] [--rounds 2]

Launches `torchrun --nproc-per-node 2 -m onegpu train` (FSDP2) without checkpoints, with
`checkpoint.async_save off` and with `on`, interleaved for `--rounds` rounds, and reports the
training time the saves add per save (train_time_s of the summary, which counts saves and not
start-up) and each process's peak RSS. Writes benchmarks/results/async-checkpoint.{json,md}.
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
from pathlib import Path

RESULTS = Path(__file__).parent / "results"
MODES = {"no checkpoints": None, "async_save off": "off", "async_save on": "on"}


def run(out: Path, preset: str, steps: int, every: int, mode: str | None) -> dict:
    values = {"preset": preset, "train.max_steps": steps, "train.batch_size": 4,
              "train.micro_batch_size": 2, "train.log_every": steps, "train.eval_every": 0,
              "train.device": "cpu", "dist.strategy": "fsdp", "out.progress": "false",
              "checkpoint.every": every if mode else 0, "checkpoint.keep_last": 2,
              "checkpoint.async_save": mode or "off", "out.dir": out}  # fmt: skip
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
           "-m", "onegpu", "train", *(f"--{k}={v}" for k, v in values.items())]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 2) // 2))}
    subprocess.run(cmd, check=True, env=env, capture_output=True, text=True)
    s = json.loads((out / "summary.json").read_text())
    return {"train_time_s": s["train_time_s"],
            "peak_rss": max(r["peak_mem_bytes"] for r in s["dist"]["per_rank"])}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="small")
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--every", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=2)
    a = ap.parse_args()
    saves = a.steps // a.every
    got: dict[str, list[dict]] = {m: [] for m in MODES}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(a.rounds):
            for name, mode in MODES.items():
                out = Path(tmp) / f"{r}-{mode}"
                got[name].append(run(out, a.preset, a.steps, a.every, mode))
    base = statistics.median(x["train_time_s"] for x in got["no checkpoints"])
    rows = []
    for name, runs in got.items():
        t = statistics.median(x["train_time_s"] for x in runs)
        rows.append({"mode": name, "train_time_s": t,
                     "per_save_s": (t - base) / saves if MODES[name] else 0.0,
                     "peak_rss": max(x["peak_rss"] for x in runs)})  # fmt: skip
    machine = f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores"
    cmd = f"python benchmarks/async_checkpoint.py --preset {a.preset} --steps {a.steps} --every {a.every} --rounds {a.rounds}"  # fmt: skip
    lines = [f"# Sharded checkpoint cost: FSDP2, 2 processes, {a.preset}, {saves} saves in "
             f"{a.steps} steps", "", f"`{cmd}`; {machine}; median of {a.rounds} rounds.", "",
             "| mode | train time | added per save | peak RSS per process |", "|---|---|---|---|"]  # fmt: skip
    for row in rows:
        lines.append(f"| {row['mode']} | {row['train_time_s']:.2f} s | {row['per_save_s']:.3f} s "
                     f"| {row['peak_rss'] / 2**20:,.0f} MiB |")  # fmt: skip
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "async-checkpoint.json").write_text(json.dumps({"command": cmd, "machine": machine, "rows": rows}, indent=1) + "\n")  # fmt: skip
    (RESULTS / "async-checkpoint.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
