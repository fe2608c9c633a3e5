"""Do two source trees plan the same? `onegpu plan` of every configuration of
plan_accuracy.py's grid (on this CPU) and of a few GPU targets with their fix lists, from each
tree in a fresh process (PYTHONPATH set to the tree's src/), compared byte for byte; the one
line that varies, how long the plan took, is left out. Exits 1 if any differs.

Usage:
  git worktree add /tmp/before HEAD~1
  python benchmarks/plan_predictions.py --before /tmp/before --after . [--out FILE]
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
from pathlib import Path

from plan_accuracy import GRID

GPU_TARGETS: list[list[str]] = [
    ["--preset", "gpt2-xl", "--gpu", "RTX4090"],
    ["--preset", "gpt2-xl", "--gpu", "A100-40"],
    [
        "--model.hf",
        "llama-3-8b",
        "--gpu",
        "H100-80",
        "--model.seq_len",
        "2048",
        "--train.micro_batch_size",
        "1",
    ],
    [
        "--model.hf",
        "llama-3-8b",
        "--gpu",
        "RTX4090",
        "--model.seq_len",
        "2048",
        "--train.batch_size",
        "8",
        "--train.micro_batch_size",
        "1",
    ],
]


def args_of(overrides: dict[str, str]) -> list[str]:
    preset = overrides.get("__preset", "tiny")
    out = ["--preset", preset]
    for key, value in overrides.items():
        if key != "__preset":
            out += [f"--{key}", value]
    return out


def plan(tree: str, args: list[str]) -> str:
    env = {**os.environ, "PYTHONPATH": str(Path(tree).resolve() / "src")}
    proc = subprocess.run([sys.executable, "-m", "onegpu", "plan", *args], env=env,
                          capture_output=True, text=True)  # fmt: skip
    text = proc.stdout + proc.stderr + f"\nexit {proc.returncode}\n"
    return re.sub(r"followed on fake tensors, [0-9.]+ s", "followed on fake tensors", text)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--before", required=True)
    ap.add_argument("--after", required=True)
    ap.add_argument("--out", help="write the comparison here")
    a = ap.parse_args()
    cases = [(name, args_of(o)) for name, o in GRID] + [(" ".join(g), g) for g in GPU_TARGETS]
    lines, bad = [], 0
    for name, args in cases:
        before, after = plan(a.before, args), plan(a.after, args)
        same = before == after
        bad += not same
        peak = re.search(r"peak \(predicted\)\s+([0-9,.]+)", after)
        lines.append(f"{'identical' if same else 'DIFFERENT'}  {name}  (peak "
                     f"{peak.group(1) if peak else '?'} MiB, {len(after.splitlines())} lines)")  # fmt: skip
        print(lines[-1], flush=True)
        if not same:
            import difflib

            diff = difflib.unified_diff(before.splitlines(), after.splitlines(), lineterm="")
            print("\n".join(list(diff)[:40]))
    lines.append(f"{len(cases) - bad} of {len(cases)} plans byte-identical")
    print(lines[-1])
    if a.out:
        Path(a.out).write_text("\n".join(lines) + "\n")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
