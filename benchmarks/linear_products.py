"""A linear layer's products on this CPU, each way onegpu could run them, round by round in one
process: the forward with its bias (ATen's `addmm`, which copies the bias into the output first,
against oneDNN's epilogue, techniques/bias_epilogue.py) and the weight gradient (autograd's
`mm(x.t(), dy)` on a transposed view, against the same product on an operand already laid out
transposed, and with inductor making that copy first).

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4 \\
        python benchmarks/linear_products.py [--rounds 9]

Shapes: every distinct linear of benchmarks/vs_peers.py's B (d 384) and of GPT-2 124M (d 768),
4,096 tokens, bf16. A way's ratio is the median over rounds of the ATen way's time over its own
in the same round, so a shared machine's drift cancels; `same bits` checks its result against
ATen's. Writes results/linear-products-<date>.{md,json} (never over an earlier file).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

from onegpu.perf.allocator import active_allocator
from onegpu.perf.devices import cpu_identity
from onegpu.techniques.bias_epilogue import available, linear_bias

sys.path.insert(0, str(Path(__file__).parent))
from records import write_table  # noqa: E402

TOKENS = 4096
SHAPES = {  # (in, out) of each distinct linear
    "B (d 384)": [(384, 384), (384, 1536), (1536, 384)],
    "GPT-2 124M (d 768)": [(768, 768), (768, 3072), (3072, 768)],
}


def _ms(fn: Callable[[], torch.Tensor], calls: int = 5) -> float:
    fn()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - t0) / calls * 1e3


def ways(k: int, n: int) -> dict[str, dict[str, Callable[[], torch.Tensor]]]:
    """Per product, the ways to run it; the first is ATen's, as eager autograd runs it."""
    x = torch.randn(TOKENS, k, dtype=torch.bfloat16)
    w = torch.randn(n, k, dtype=torch.bfloat16)
    b = torch.randn(n, dtype=torch.bfloat16)
    dy = torch.randn(TOKENS, n, dtype=torch.bfloat16)
    x_t = x.t().contiguous()
    copy_then_mm = torch.compile(lambda x, dy: torch.mm(x.t().contiguous(), dy), dynamic=False)
    forward = {"addmm (ATen)": lambda: torch.addmm(b, x, w.t())}
    if available():
        forward["bias in oneDNN's epilogue"] = lambda: linear_bias(x, w, b)
    return {
        "forward": forward,
        "weight gradient": {
            "mm(x.t(), dy) (ATen)": lambda: torch.mm(x.t(), dy),
            "x laid out transposed": lambda: torch.mm(x_t, dy),
            "inductor's transpose, then mm": lambda: copy_then_mm(x, dy),
        },
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=9)
    args = parser.parse_args()
    torch.manual_seed(0)
    rows = []
    for model, shapes in SHAPES.items():
        for k, n in shapes:
            for product, found in ways(k, n).items():
                names = list(found)
                times: dict[str, list[float]] = {name: [] for name in names}
                for _ in range(args.rounds):
                    for name in names:
                        times[name].append(_ms(found[name]))
                reference = found[names[0]]()
                for name in names:
                    ratios = [a / b for a, b in zip(times[names[0]], times[name])]
                    rows.append(
                        {
                            "model": model,
                            "shape": f"{TOKENS} x {k} -> {n}",
                            "product": product,
                            "way": name,
                            "ms": statistics.median(times[name]),
                            "x ATen": statistics.median(ratios),
                            "same bits": bool(torch.equal(found[name](), reference)),
                        }
                    )
                    print(rows[-1], flush=True)
    write(rows, args)


def write(rows: list[dict], args: argparse.Namespace) -> None:
    command = f"python benchmarks/linear_products.py --rounds {args.rounds}"
    head = (
        f"# A linear's products, each way\n\n`{command}`; {torch.get_num_threads()} threads "
        f"({cpu_identity()}), torch {torch.__version__}, allocator {active_allocator()}; "
        f"{time.strftime('%Y-%m-%d')}; median ms and median per-round ratio to ATen's way "
        f"over {args.rounds} rounds.\n\n"
    )
    columns = ["model", "shape", "product", "way", "ms", "x ATen", "same bits"]
    cells = [
        [r["model"], r["shape"], r["product"], r["way"], f"{r['ms']:.2f}", f"{r['x ATen']:.2f}"]
        + ["yes" if r["same bits"] else "no"]
        for r in rows
    ]
    write_table("linear-products", head, columns, cells, {"command": command, "rows": rows})


if __name__ == "__main__":
    main()
