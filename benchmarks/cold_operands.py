"""A linear's products with their operands in cache and out of it: how much of a step's
"products beyond their floor" is the floor timing each product on warm operands.

The floor (perf/floor.py) times each product alone, call after call on the same tensors, so its
operands sit in the core's cache. In a step they rarely do: a weight gradient reads a layer's
input saved in forward, long evicted. Here each product runs over the same tensors every call
(hot), and over OPERAND_SETS distinct sets in turn (cold: together far larger than the caches),
interleaved round by round in one process.

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4 \\
        python benchmarks/cold_operands.py [--rounds 5]

Shapes: every distinct linear of benchmarks/vs_peers.py's B (d 384), 4,096 tokens, bf16, as
autograd runs them: the forward (x w^T), the input gradient (dy w) and the weight gradient
(dy^T x on a transposed view). `x cold` is the median over rounds of cold over hot in the same
round. Writes results/cold-operands-<date>.{md,json} (never over an earlier file).
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

sys.path.insert(0, str(Path(__file__).parent))
from records import write_table  # noqa: E402

TOKENS = 4096
LINEARS = [(384, 384), (384, 1536), (1536, 384)]  # (in, out) of each distinct linear of B
OPERAND_SETS = 24
"""Distinct operand sets the cold runs cycle through: 24 x 3-15 MB, beyond the caches here."""

Product = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
PRODUCTS: dict[str, Product] = {
    "forward x w^T": lambda x, w, dy: torch.mm(x, w.t()),
    "input gradient dy w": lambda x, w, dy: torch.mm(dy, w),
    "weight gradient dy^T x": lambda x, w, dy: torch.mm(dy.t(), x),
}


def operand_sets(k: int, n: int) -> list[tuple[torch.Tensor, ...]]:
    """(x [tokens, in], w [out, in], dy [tokens, out]) in bf16, OPERAND_SETS times."""
    shapes = ((TOKENS, k), (n, k), (TOKENS, n))
    return [
        tuple(torch.randn(s, dtype=torch.bfloat16) for s in shapes) for _ in range(OPERAND_SETS)
    ]


def median_ms(product: Product, sets: list[tuple[torch.Tensor, ...]]) -> float:
    """The median call over one pass through `sets` (the same set repeated: hot)."""
    times = []
    for operands in sets:
        t0 = time.perf_counter()
        product(*operands)
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    torch.manual_seed(0)
    rows = []
    for k, n in LINEARS:
        sets = operand_sets(k, n)
        for name, product in PRODUCTS.items():
            product(*sets[0])  # oneDNN's first call for a shape picks and builds its kernel
            hot, cold = [], []
            for _ in range(args.rounds):
                hot.append(median_ms(product, sets[:1] * OPERAND_SETS))
                cold.append(median_ms(product, sets))
            rows.append(
                {
                    "shape": f"{TOKENS} x {k} -> {n}",
                    "product": name,
                    "hot ms": statistics.median(hot),
                    "cold ms": statistics.median(cold),
                    "x cold": statistics.median(c / h for c, h in zip(cold, hot)),
                }
            )
            print(rows[-1], flush=True)
    write(rows, args)


def write(rows: list[dict], args: argparse.Namespace) -> None:
    command = f"python benchmarks/cold_operands.py --rounds {args.rounds}"
    head = (
        f"# A linear's products, operands in cache (hot) and not (cold)\n\n`{command}`; "
        f"{torch.get_num_threads()} threads ({cpu_identity()}), torch {torch.__version__}, "
        f"allocator {active_allocator()}; {time.strftime('%Y-%m-%d')}; medians over "
        f"{args.rounds} rounds, cold cycling through {OPERAND_SETS} operand sets.\n\n"
    )
    columns = ["shape", "product", "hot ms", "cold ms", "x cold"]
    cells = [
        [
            r["shape"],
            r["product"],
            f"{r['hot ms']:.2f}",
            f"{r['cold ms']:.2f}",
            f"{r['x cold']:.2f}",
        ]
        for r in rows
    ]
    write_table("cold-operands", head, columns, cells, {"command": command, "rows": rows})


if __name__ == "__main__":
    main()
