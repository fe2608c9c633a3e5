"""What `auto`'s trials measure on a quiet machine and beside one busy process, and whether
perf/contention.py tells the two apart.

    LD_PRELOAD=$(python -c "from onegpu.perf.allocator import find_mimalloc as f; print(f())") \\
        MIMALLOC_PURGE_DELAY=-1 python benchmarks/contention.py [--rounds 2]

Each trial `auto` caches (attention at model B's call, the chunked loss's kernels at B's and
A's shape, the bf16 matmul peak, JAX's precision products; needs the `jax` extra) runs `--rounds` times quiet and `--rounds` times while another
process spins on one core (a plain Python loop, unpinned: what a second job on the machine
does), alternately. Recorded for each run: the trial's figures, the choice they make, and the
threads' wait for a CPU over their run time (RunQueueWatch), against MAX_WAIT_SHARE. Nothing
is read from or written to the cache. Writes results/contention-<date>.{md,json} (never over
an earlier file). Run nothing else meanwhile.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from onegpu.perf.allocator import active_allocator
from onegpu.perf.contention import MAX_WAIT_SHARE, RunQueueWatch
from onegpu.perf.devices import cpu_identity, measure_matmul_flops
from onegpu.techniques.attention import AttentionCall, measure_cpu_attention
from onegpu.techniques.kernel_trial import choose
from onegpu.techniques.loss_kernel_auto import LossShape, measure_loss_kernel

sys.path.insert(0, str(Path(__file__).parent))
from vs_peers import RESULTS, _new_stem  # noqa: E402

CPU = torch.device("cpu")
BF16, FP32 = torch.bfloat16, torch.float32


def _loss_kernel(shape: LossShape) -> Callable[[], dict[str, Any]]:
    def trial() -> dict[str, Any]:
        found = measure_loss_kernel(shape, CPU)
        return found | {"choice at 5,000 micro-batches": choose(found, 5000)}

    return trial


TRIALS: dict[str, Callable[[], dict[str, Any]]] = {
    "attention, B's call (16 x 6 heads x 256 x 64)": lambda: measure_cpu_attention(
        AttentionCall(16, 6, 256, 64), BF16, ("sdpa", "plain", "blocked")
    ),
    "loss kernels, B's shape (4,096 x 384 x 8,192)": _loss_kernel(
        LossShape(4096, 384, 8192, 8192, 1024, BF16, FP32)
    ),
    "loss kernels, A's shape (4,096 x 256 x 50,304)": _loss_kernel(
        LossShape(4096, 256, 50304, 50257, 1024, BF16, FP32)
    ),
    "bf16 matmul peak (2,048^3)": lambda: {
        "GFLOP/s": round(measure_matmul_flops(BF16, CPU, n=2048) / 1e9, 1)
    },
    "JAX precision: B's MLP product, fp32 vs bf16 (4,096 x 384 x 1,536)": lambda: _jax_products(),
}


def _jax_products() -> dict[str, Any]:
    """XLA's trial for `train.precision auto` on the JAX backend (its threads, not torch's)."""
    from onegpu.backends.jax.precision import measure_products

    return {k: round(v, 5) for k, v in measure_products((4096, 384, 1536)).items()}


def _busy() -> subprocess.Popen:
    """Another process spinning on whichever core the scheduler gives it."""
    proc = subprocess.Popen(
        [sys.executable, "-c", "import sys\nprint(flush=True)\nwhile True: pass"],
        stdout=subprocess.PIPE,
    )
    proc.stdout.readline()
    return proc


def run(name: str, busy: bool) -> dict[str, Any]:
    watch = RunQueueWatch()
    proc = _busy() if busy else None
    try:
        with watch.watching():
            found = TRIALS[name]()
    finally:
        if proc is not None:
            proc.kill()
            proc.wait()
    share = watch.wait_share()
    return {
        "trial": name,
        "beside a busy process": busy,
        "wait share": None if share is None else round(share, 4),
        "cached": not watch.disturbed(),
        "found": found,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    rows = []
    for name in TRIALS:
        for _ in range(args.rounds):
            for busy in (False, True):
                rows.append(run(name, busy))
                print(json.dumps(rows[-1]), flush=True)
    machine = (
        f"{os.cpu_count()} cores ({cpu_identity()}), torch {torch.__version__}, allocator "
        f"{active_allocator()}, {torch.get_num_threads()} threads"
    )
    stem = _new_stem(f"contention-{datetime.date.today().isoformat()}")
    (RESULTS / f"{stem}.json").write_text(json.dumps({"machine": machine, "rows": rows}, indent=1))
    lines = [
        "# `auto`'s trials on a quiet machine and beside one busy process",
        "",
        f"Machine: {machine}. Command: `python benchmarks/contention.py --rounds {args.rounds}`.",
        f"A trial is disturbed (not cached) above a wait share of {MAX_WAIT_SHARE:.0%}.",
        "",
        "| trial | busy process | wait share | cached | what it measured |",
        "|---|---|---|---|---|",
    ]
    for r in rows:
        share = "-" if r["wait share"] is None else f"{r['wait share']:.1%}"
        busy = "yes" if r["beside a busy process"] else "no"
        cached = "yes" if r["cached"] else "**no**"
        lines.append(f"| {r['trial']} | {busy} | {share} | {cached} | `{json.dumps(r['found'])}` |")
    (RESULTS / f"{stem}.md").write_text("\n".join(lines) + "\n")
    print(f"wrote {RESULTS / stem}.md")


if __name__ == "__main__":
    main()
