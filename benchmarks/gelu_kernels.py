"""The tanh GELU's kernels alone, forward and backward, at models A's and B's MLP activation:
ATen's (what eager runs), the compiled sigmoid form (`train.gelu_kernel compiled`), and for
scale ATen's erf GELU and `torch.tanh` in fp32 and bf16.

    python benchmarks/gelu_kernels.py [--rounds 5]

Interleaved rounds, each figure a round's best of 5 calls, the median over rounds. Writes
results/gelu-kernels-<date>[-N].{md,json} (never over an earlier file). Run nothing else
meanwhile.
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

from onegpu.models.gpt import tanh_gelu_sigmoid_form
from onegpu.perf.devices import cpu_identity
from onegpu.techniques.gelu_kernel import tanh_gelu_grad

sys.path.insert(0, str(Path(__file__).parent))
from rate_drift import best_of  # noqa: E402
from vs_peers import RESULTS, _new_stem  # noqa: E402

SHAPES = {"B": (16 * 256, 4 * 384), "A": (8 * 512, 4 * 256)}


def best_ms(fn) -> float:
    return best_of(fn) * 1e3


def kernels(tokens: int, hidden: int) -> dict:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(tokens, hidden, generator=gen).bfloat16()
    g = torch.randn(tokens, hidden, generator=gen).bfloat16()
    x32 = x.float()
    forward = torch.compile(tanh_gelu_sigmoid_form, fullgraph=True)
    backward = torch.compile(tanh_gelu_grad, fullgraph=True)
    return {
        "ATen tanh GELU forward": lambda: F.gelu(x, approximate="tanh"),
        "ATen tanh GELU backward": lambda: torch.ops.aten.gelu_backward(g, x, approximate="tanh"),
        "compiled forward (sigmoid form)": lambda: forward(x),
        "compiled backward (sigmoid form)": lambda: backward(g, x),
        "ATen erf GELU forward": lambda: F.gelu(x),
        "torch.tanh, fp32": lambda: torch.tanh(x32),
        "torch.tanh, bf16": lambda: torch.tanh(x),
    }


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--rounds", type=int, default=5)
    a = ap.parse_args()
    results = {}
    for model, (tokens, hidden) in SHAPES.items():
        fns = kernels(tokens, hidden)
        for fn in fns.values():  # compiles, warms up
            fn()
        times = {name: [] for name in fns}
        for _ in range(a.rounds):
            for name, fn in fns.items():
                times[name].append(best_ms(fn))
        results[model] = {name: statistics.median(ts) for name, ts in times.items()}
    command = f"python benchmarks/gelu_kernels.py --rounds {a.rounds}"
    lines = [
        "# The tanh GELU's kernels alone (bf16)",
        "",
        f"`{command}`; {cpu_identity()}, {torch.get_num_threads()} threads, torch"
        f" {torch.__version__}; {datetime.date.today()}. ms, the median over {a.rounds} interleaved"
        " rounds of each round's best of 5 calls.",
        "",
        "| kernel | " + " | ".join(f"{m} ({t:,} x {h:,})" for m, (t, h) in SHAPES.items()) + " |",
        "|---|" + "---|" * len(SHAPES),
    ]
    for name in results["B"]:
        lines.append(f"| {name} | " + " | ".join(f"{results[m][name]:.2f}" for m in SHAPES) + " |")
    stem = _new_stem(f"gelu-kernels-{datetime.date.today()}")
    (RESULTS / f"{stem}.md").write_text("\n".join(lines) + "\n")
    (RESULTS / f"{stem}.json").write_text(json.dumps({"command": command, "ms": results}, indent=1))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
