"""The step's matmul floor as a contestant in turns (benchmarks/paired.py), so that a step's
multiple of its floor compares the two in the same moments of a shared machine.

    python benchmarks/floor_turns.py --model B --steps-file F [--flags '["--model.attention", "blocked"]']

The floor (perf/floor.py) times each product alone, the best of several samples, and keeps the
least a product has been seen to take; a step is a median over whatever moments it ran in. On a
VM whose matmul rate moves 2-3x within seconds (results/rate-drift-2026-12-06.md) that compares a
fast moment with a typical one: B's floor read 374 ms one afternoon and 198 ms (1.82 TFLOP/s)
the next hour. This process runs every product of onegpu's step, as the floor counts them and
with the kernels onegpu runs them with, pass after pass, and logs each pass's time as a step
(one JSON line, `step_time_s`, flushed), so benchmarks/vs_peers.py and benchmarks/step_cuts.py
can time it in turns beside the steps: `x floor in turns` is the median over cycles of each
cycle's step over that cycle's pass.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import Counter
from pathlib import Path

import torch

from onegpu.backends.torch.floor import micro_batch_gemms
from onegpu.perf.floor import Gemm, operand
from onegpu.techniques.bias_epilogue import runs_as

sys.path.insert(0, str(Path(__file__).parent))

NAME = "matmul floor"
"""The contestant's name (a suffix tells several floors apart)."""
PASSES = 100_000  # more than any run in turns asks for: the turns end the process


def products(model: str, extra: list[str]) -> list[Gemm]:
    """Every product of one optimizer step of the model with the cut's `extra` flags."""
    from vs_peers import model_config  # here: vs_peers imports this module

    cfg = model_config(model, extra)
    return micro_batch_gemms(cfg, torch.device("cpu")) * cfg.grad_accum_steps


def signature(model: str, extra: list[str]) -> tuple[str, ...]:
    """What tells two cuts' floors apart: their products' keys and counts."""
    return tuple(
        sorted(f"{n}x{g.key()}|{g.share}" for g, n in Counter(products(model, extra)).items())
    )


def command(model: str, extra: list[str], steps_file: Path) -> list[str]:
    return [sys.executable, __file__, "--model", model, "--steps-file", str(steps_file),
            "--flags", json.dumps(extra)]  # fmt: skip


def run_passes(model: str, extra: list[str], steps_file: Path) -> None:
    """Pass after pass over the step's products, each distinct one run back to back as many
    times as the step runs it (a causal attention product's time counted at its share)."""
    cpu = torch.device("cpu")
    prepared = []
    for gemm, n in Counter(products(model, extra)).items():
        args = [operand(spec, gemm.dtype, cpu) for spec in gemm.args]
        op, args = runs_as(getattr(torch.ops.aten, gemm.op), args)
        prepared.append((op, args, n, gemm.share))
    with open(steps_file, "a") as log:
        for _ in range(PASSES):
            total = 0.0
            for op, args, n, share in prepared:
                t0 = time.perf_counter()
                for _ in range(n):
                    op(*args)
                total += share * (time.perf_counter() - t0)
            log.write(json.dumps({"step_time_s": total}) + "\n")
            log.flush()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--steps-file", type=Path, required=True)
    ap.add_argument("--flags", default="[]", help="a JSON list of the cut's onegpu flags")
    a = ap.parse_args()
    run_passes(a.model, json.loads(a.flags), a.steps_file)


if __name__ == "__main__":
    main()
