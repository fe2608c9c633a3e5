"""Allocator settings chosen from speed and peak RSS: mimalloc's purge delay (how long freed
pages stay before they go back to the kernel), tcmalloc, and glibc tuned in-process, each as the
host allocator of a real `onegpu train` (its defaults and its 200-step schedule, stopped with
SIGTERM once enough log intervals are timed; no evaluation, no checkpoints).

    python benchmarks/allocator_settings.py --model A|B [--rounds 2] [--steps 30]

Models as benchmarks/vs_peers.py. Each row a fresh process, rounds interleaved; tokens/s is the
median of the 5-step log intervals after the first, peak RSS the process's ru_maxrss. A first,
uncounted run fills the per-machine caches (tokenizer, attention, loss chunk).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from vs_peers import MODELS  # noqa: E402

SETTINGS = {
    "mimalloc, purge never (onegpu's setting)": {"ONEGPU_ALLOCATOR": "mimalloc",
                                                 "MIMALLOC_PURGE_DELAY": "-1"},
    "mimalloc, purge after 10 ms (as shipped)": {"ONEGPU_ALLOCATOR": "mimalloc",
                                                 "MIMALLOC_PURGE_DELAY": "10"},
    "mimalloc, purge after 1 s": {"ONEGPU_ALLOCATOR": "mimalloc", "MIMALLOC_PURGE_DELAY": "1000"},
    "tcmalloc (system package), release rate as shipped": {"ONEGPU_ALLOCATOR": "tcmalloc"},
    "glibc tuned in-process": {"ONEGPU_ALLOCATOR": "glibc-tuned"},
}  # fmt: skip
WRAPPER = (
    "import resource, signal, subprocess, sys\n"
    "p = subprocess.Popen(sys.argv[1:], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)\n"
    "signal.signal(signal.SIGTERM, lambda *a: p.send_signal(signal.SIGTERM))\n"
    "p.wait()\n"
    "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)\n"
)


def one(model: str, steps: int, env: dict[str, str]) -> tuple[float, float]:
    """(tokens/s, peak RSS MiB) of one run."""
    with tempfile.TemporaryDirectory() as d:
        cmd = ["onegpu", "train", *MODELS[model]["args"], "--train.max_steps", "200",
               "--train.log_every", "5", "--train.eval_every", "0", "--checkpoint.every", "0",
               "--out", f"{d}/r", "--out.progress", "false"]  # fmt: skip
        p = subprocess.Popen([sys.executable, "-c", WRAPPER, *cmd], env={**os.environ, **env},
                             stdout=subprocess.PIPE, text=True)  # fmt: skip
        rows: list[dict] = []
        while p.poll() is None:
            time.sleep(1)
            path = Path(d) / "r" / "metrics.jsonl"
            rows = [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []
            if sum("tokens_per_s" in r for r in rows) >= steps // 5:
                p.terminate()
                break
        out, _ = p.communicate()
    speeds = [r["tokens_per_s"] for r in rows if r.get("tokens_per_s")][1:]
    return statistics.median(speeds), int(out.split()[-1]) / 1024


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", default="B", choices=("A", "B"))
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--steps", type=int, default=30)
    a = ap.parse_args()
    one(a.model, 10, SETTINGS["glibc tuned in-process"])  # fills the caches, uncounted
    got: dict[str, list[tuple[float, float]]] = {k: [] for k in SETTINGS}
    for _ in range(a.rounds):
        for name, env in SETTINGS.items():
            got[name].append(one(a.model, a.steps, env))
            print(name, got[name][-1], flush=True)
    print(f"| setting | {a.model} tokens/s | {a.model} peak RSS |\n|---|---|---|")
    for name, rs in got.items():
        print(f"| {name} | {statistics.median(r[0] for r in rs):,.0f} | "
              f"{statistics.median(r[1] for r in rs):,.0f} MiB |")  # fmt: skip


if __name__ == "__main__":
    main()
