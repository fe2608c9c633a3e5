"""How much this machine's own speed moves while nothing else of ours runs: a bf16 and an fp32
matmul and one elementwise kernel, probed every `--every` seconds for `--seconds`.

    python benchmarks/rate_drift.py [--seconds 60] [--every 1.5]

A 2-core cloud VM shares its physical cores (and an AMX unit, which SMT siblings share) with
whatever the host runs beside it. Linux's scheduler statistics (perf/contention.py) see
another process of this VM, never a neighbour on the host: this probe sees both, as a rate
that changes. Each probe is the best of 5 back-to-back calls, so a probe's figure is that
moment's rate, not one unlucky call. Writes results/rate-drift-<date>[-N].{md,json} (never
over an earlier file). Run nothing else meanwhile: the point is what the machine does alone.
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from onegpu.perf.devices import cpu_identity

sys.path.insert(0, str(Path(__file__).parent))
from vs_peers import RESULTS, _new_stem  # noqa: E402

N = 2048
"""A square product big enough to run at the machine's peak, small enough to probe often."""
ELEMENTS = 4096 * 1536
"""Model B's MLP activation (16 x 256 tokens x 1,536), the GELU the step runs."""


def best_of(fn, calls: int = 5) -> float:
    fn()
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def probe() -> dict[str, float]:
    """This moment's rates: bf16 and fp32 matmul GFLOP/s, the bf16 tanh-GELU's ms."""
    out = {}
    for name, dtype in (("bf16_gflops", torch.bfloat16), ("fp32_gflops", torch.float32)):
        a, b = torch.randn(N, N, dtype=dtype), torch.randn(N, N, dtype=dtype)
        out[name] = 2 * N**3 / best_of(lambda: a @ b) / 1e9  # noqa: B023
    x = torch.randn(ELEMENTS, dtype=torch.bfloat16)
    out["gelu_ms"] = best_of(lambda: F.gelu(x, approximate="tanh")) * 1e3
    return out


def summarise(samples: list[dict[str, float]]) -> dict[str, dict[str, float]]:
    """Per probe: min, median, max and max/min (how far apart the machine's states are)."""
    summary = {}
    for key in samples[0]:
        values = [s[key] for s in samples]
        lo, hi = min(values), max(values)
        summary[key] = {
            "min": lo,
            "median": statistics.median(values),
            "max": hi,
            "spread": hi / lo,
        }
    return summary


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--seconds", type=float, default=60.0)
    ap.add_argument("--every", type=float, default=1.5)
    a = ap.parse_args()
    samples, start = [], time.time()
    while time.time() - start < a.seconds:
        samples.append({"t": round(time.time() - start, 1)} | probe())
        print(samples[-1], flush=True)
        time.sleep(a.every)
    rates = [{k: v for k, v in s.items() if k != "t"} for s in samples]
    summary = summarise(rates)
    command = f"python benchmarks/rate_drift.py --seconds {a.seconds:g} --every {a.every:g}"
    lines = [
        "# How far this machine's speed moves on its own",
        "",
        f"`{command}`; {cpu_identity()}, {torch.get_num_threads()} threads, torch {torch.__version__};"
        f" {datetime.date.today()}. {len(samples)} probes, each the best of 5 back-to-back calls:"
        f" a {N}^3 matmul in bf16 and fp32, and the tanh GELU over {ELEMENTS:,} bf16 values.",
        "",
        "| probe | min | median | max | max / min |",
        "|---|---|---|---|---|",
    ]
    for key, s in summary.items():
        lines.append(
            f"| {key} | {s['min']:,.1f} | {s['median']:,.1f} | {s['max']:,.1f} | {s['spread']:.2f} |"
        )
    lines += ["", "| t (s) | bf16 GFLOP/s | fp32 GFLOP/s | GELU ms |", "|---|---|---|---|"]
    lines += [
        f"| {s['t']} | {s['bf16_gflops']:,.0f} | {s['fp32_gflops']:,.0f} | {s['gelu_ms']:.2f} |"
        for s in samples
    ]
    stem = _new_stem(f"rate-drift-{datetime.date.today()}")
    (RESULTS / f"{stem}.md").write_text("\n".join(lines) + "\n")
    (RESULTS / f"{stem}.json").write_text(
        json.dumps({"command": command, "summary": summary, "samples": samples}, indent=1)
    )
    print("\n".join(lines[:10]))
    print(f"wrote {RESULTS / stem}.md")


if __name__ == "__main__":
    main()
