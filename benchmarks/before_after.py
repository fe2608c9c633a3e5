"""`onegpu train` from two source trees, interleaved: did a change make training slower?

Each round runs the same command once per tree, in a fresh process (PYTHONPATH set to the
tree's src/), alternating which goes first; rows report the median over rounds of the run's
steady tokens/s (summary.json), and the ratio after / before.

Usage:
  git worktree add /tmp/before HEAD~1
  python benchmarks/before_after.py --before /tmp/before --after . --rounds 3 -- --preset small
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


def run(tree: str, args: list[str], workdir: Path) -> dict:
    out = workdir / f"run{time.monotonic_ns()}"
    env = {**os.environ, "PYTHONPATH": str(Path(tree).resolve() / "src")}
    cmd = [sys.executable, "-m", "onegpu", "train", *args, "--out", str(out),
           "--out.progress", "false", "--out.save_checkpoint", "false"]  # fmt: skip
    subprocess.run(cmd, env=env, check=True, capture_output=True, cwd=workdir)
    return json.loads((out / "summary.json").read_text())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--before", required=True, help="source tree (holding src/onegpu) before")
    ap.add_argument("--after", required=True, help="source tree after")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json", help="write the results here too")
    ap.add_argument("train_args", nargs="*", help="arguments of onegpu train (after --)")
    a = ap.parse_args()
    trees = {"before": a.before, "after": a.after}
    results: dict[str, list[dict]] = {k: [] for k in trees}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(a.rounds):
            order = list(trees) if r % 2 == 0 else list(reversed(trees))
            for name in order:
                s = run(trees[name], a.train_args, Path(tmp))
                results[name].append(s)
                print(f"round {r + 1} {name}: {s['tokens_per_s']:,.0f} tokens/s, "
                      f"loss {s['loss']:.4f}", flush=True)  # fmt: skip
    med = {k: statistics.median(s["tokens_per_s"] for s in v) for k, v in results.items()}
    report = {
        "command": "onegpu train " + " ".join(a.train_args),
        "rounds": a.rounds,
        "tokens_per_s": {k: [s["tokens_per_s"] for s in v] for k, v in results.items()},
        "median_tokens_per_s": med,
        "after_over_before": med["after"] / med["before"],
        "same_final_loss": results["before"][0]["loss"] == results["after"][0]["loss"],
        "device": results["after"][0]["device_name"],
        "platform": platform.platform(),
        "torch": results["after"][0].get("torch"),
        "jax": results["after"][0].get("environment", {}).get("jax"),
        "cpu_bf16": _cpu_bf16(),
    }
    print(json.dumps(report, indent=1))
    if a.json:
        Path(a.json).write_text(json.dumps(report, indent=1) + "\n")


def _cpu_bf16() -> str:
    """Which bf16 matmul units this CPU has (results differ by kind: CPU-NOTES)."""
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return "unknown"
    found = [f for f in ("amx_bf16", "avx512_bf16") if f in flags]
    return ", ".join(found) or "none (AVX2: bf16 emulated)"


if __name__ == "__main__":
    main()
