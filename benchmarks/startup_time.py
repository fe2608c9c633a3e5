"""How long a tiny `onegpu train` takes from the command to its exit, against the code before a
change: the start (imports, data listing and tokens, model build) is most of a short run's time
and of every test that starts one.

Each run is a fresh process of `onegpu train --preset tiny --train.max_steps 2` on the default
`stdlib` data (its token cache warm after an untimed first run of each), the two checkouts
interleaved, the median of `--rounds` wall times each.

    python benchmarks/startup_time.py --before OTHER_CHECKOUT/src [--rounds 5]

Writes benchmarks/results/startup-time-<date>.md (a new file each run).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from records import bf16_kind, commit_of, write_result

from onegpu.perf.devices import cpu_name

COMMAND = ["-m", "onegpu", "train", "--preset", "tiny", "--train.max_steps", "2",
           "--train.compile", "none", "--out.progress", "false"]  # fmt: skip


def run(src: Path, out: Path) -> float:
    """Wall seconds of one run of `src`'s onegpu, from the process's start to its exit."""
    env = {**os.environ, "PYTHONPATH": str(src)}
    t0 = time.perf_counter()
    subprocess.run([sys.executable, *COMMAND, "--out.dir", str(out)], env=env, check=True,
                   capture_output=True)  # fmt: skip
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--before", required=True, help="another checkout's src/ (the code before)")
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    srcs = {"before": Path(args.before).resolve(), "after": Path(__file__).parents[1] / "src"}
    times: dict[str, list[float]] = {name: [] for name in srcs}
    with tempfile.TemporaryDirectory() as tmp:
        for name, src in srcs.items():  # untimed: the token cache and .pyc files are made
            run(src, Path(tmp) / f"warm-{name}")
        for r in range(args.rounds):
            for name, src in srcs.items():
                times[name].append(run(src, Path(tmp) / f"{name}-{r}"))
    before, after = (statistics.median(times[n]) for n in srcs)
    lines = [
        "# Wall time of a 2-step tiny `onegpu train` (CPU)",
        "",
        f"Machine: {cpu_name()} ({bf16_kind()}), {torch.get_num_threads()} threads, torch "
        f"{torch.__version__}. Command: `python benchmarks/startup_time.py --before "
        f"OTHER_CHECKOUT/src --rounds {args.rounds}`; each run `python {' '.join(COMMAND)}`.",
        "",
        "| code | commit | median wall s | all runs s |",
        "|---|---|---|---|",
        *(
            f"| {n} | {commit_of(srcs[n])} | {statistics.median(times[n]):.2f} | "
            f"{', '.join(f'{t:.2f}' for t in times[n])} |"
            for n in srcs
        ),
        "",
        f"After / before: {after / before:.2f}x the wall time.",
    ]
    write_result("startup-time", lines, show=True)


if __name__ == "__main__":
    main()
