"""The chunked loss at several chunk sizes, in the real model's forward + backward, round by
round in one process: does a chunk whose logits stay in a CPU's caches beat a larger one?

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4 \\
        python benchmarks/loss_chunks.py [--models A,B] [--rounds 12] [--kernel compiled] \\
        [--sizes 256,512,1024,2048]

Each model (benchmarks/vs_peers.py's A and B) is built once by onegpu, as
benchmarks/loss_kernels.py builds it; then one micro-batch's forward + backward runs at every
chunk size of `--sizes` below the micro-batch's tokens with the loss kernel asked for, one size
after the other, `--rounds` times. A size's ratio is the median over rounds of its time
over the largest size's in the same round, so what drifts on a shared machine between rounds
cancels. Also checks the losses agree (fp32 rounding apart). Writes
results/loss-chunks-<date>.{md,json} (never over an earlier file).

Why it exists: timed alone under glibc's malloc, B's output layer + loss ran 10-15% faster in
256-token chunks than in 2,048-token ones; under a caching allocator (what onegpu runs on) and
in the model's step, 2,048 was as fast or faster (results/loss-chunks-2026-12-06.md). The
difference was the 32 MiB logits block's pages, mapped afresh on every chunk by glibc, not the
caches. `auto` keeps its sizes (perf/logits.py).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

from onegpu.perf.allocator import active_allocator
from onegpu.perf.devices import cpu_identity
from onegpu.techniques.chunked_loss import chunked_token_loss_sum
from onegpu.techniques.loss_kernels import kernels_for

sys.path.insert(0, str(Path(__file__).parent))
from loss_kernels import _model, loss_stepper  # noqa: E402
from vs_peers import RESULTS, _new_stem  # noqa: E402


def measure(name: str, rounds: int, kernel: str, sizes: list[int]) -> dict:
    built = _model(name)
    cfg = built.cfg
    sizes = [c for c in sizes if c < cfg.train.micro_batch_size * cfg.train_seq_len]
    losses = {c: chunked_token_loss_sum(c, kernels_for(kernel)) for c in sizes}
    step, values = loss_stepper(built, losses)

    for c in sizes:  # warm up; compiled kernels compile once per chunk shape
        step(c)
        step(c)
    times: dict[int, list[float]] = {c: [] for c in sizes}
    for _ in range(rounds):
        for c in sizes:
            times[c].append(step(c))
    largest = sizes[-1]
    ratios = {
        c: statistics.median(t / r for t, r in zip(times[c], times[largest], strict=True))
        for c in sizes
    }
    return {
        "model": name,
        "kernel": kernel,
        "precision": cfg.train.precision,
        "attention": cfg.model.attention,
        "tokens": cfg.train.micro_batch_size * cfg.train_seq_len,
        "median_s": {c: statistics.median(t) for c, t in times.items()},
        "ratio_to_largest": ratios,
        "times_s": times,
        "loss": values,
    }


def table(rows: list[dict], a: argparse.Namespace) -> str:
    lines = [
        "# The chunked loss at each timed chunk size, in the real model's step",
        "",
        f"`python benchmarks/loss_chunks.py --models {a.models} --rounds {a.rounds} "
        f"--kernel {a.kernel} --sizes {a.sizes}`; {os.cpu_count()} cores ({cpu_identity()}), torch "
        f"{torch.__version__}, allocator {active_allocator()}; {time.strftime('%Y-%m-%d')}. One "
        f"micro-batch's forward + backward at each chunk size in turn, {a.rounds} rounds; "
        "medians, and the median over rounds of each size's time over the largest size's.",
        "",
        "| model | precision | attention | loss kernel | chunk | step | x the largest chunk | loss |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        for c, s in r["median_s"].items():
            lines.append(
                f"| {r['model']} | {r['precision']} | {r['attention']} | {r['kernel']} | {c} "
                f"| {s * 1e3:,.0f} ms | {r['ratio_to_largest'][c]:.3f} | {r['loss'][c]:.6f} |"
            )
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--models", default="A,B")
    ap.add_argument("--rounds", type=int, default=12)
    ap.add_argument("--kernel", default="compiled", choices=["compiled", "eager"])
    ap.add_argument("--sizes", default="256,512,1024,2048", help="chunk sizes, in tokens")
    a = ap.parse_args()
    # the compiled kernels are made per shape: here every size's, where a run has one or two
    torch._dynamo.config.recompile_limit = 64
    sizes = sorted(int(c) for c in a.sizes.split(","))
    rows = [measure(m, a.rounds, a.kernel, sizes) for m in a.models.split(",")]
    text = table(rows, a)
    print(text)
    stem = _new_stem(f"loss-chunks-{time.strftime('%Y-%m-%d')}")
    (RESULTS / f"{stem}.md").write_text(text)
    (RESULTS / f"{stem}.json").write_text(json.dumps(rows, indent=1))
    print(f"wrote {RESULTS / stem}.md")


if __name__ == "__main__":
    main()
