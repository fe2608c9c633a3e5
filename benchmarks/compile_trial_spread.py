"""How steady is `train.compile auto`'s trial? The eager / compiled ratio of repeated trials.

    python benchmarks/compile_trial_spread.py [--model B] [--trials 6]

One model (benchmarks/vs_peers.py's A or B, bf16, eager vs `default`: the whole forward and
loss compiled once, then reused), and repeated trials of two kinds, interleaved: 'in a row'
(two eager micro-batches, then two compiled, each one's minimum: `time_compile`'s trial) and
'alternated' (one eager, one compiled, ROUNDS times, each one's minimum: a candidate
replacement). A trial's ratio decides whether compiling pays; the spread of the ratios over
trials is how much of that decision is the machine's noise. Writes
results/compile-trial-spread-<model>-<date>.md (never over an earlier file).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

from onegpu.backends.torch.build import build
from onegpu.config import load_config
from onegpu.techniques import compile_auto as compile_module

sys.path.insert(0, str(Path(__file__).parent))
from records import bf16_kind, write_result  # noqa: E402
from vs_peers import MODELS  # noqa: E402

ROUNDS = 3


def in_a_row(timed, eager, compiled) -> float:
    eager_s = min(timed(eager) for _ in range(2))
    compiled_s = min(timed(compiled) for _ in range(2))
    return eager_s / compiled_s


def alternated(timed, eager, compiled) -> float:
    runs = [(timed(eager), timed(compiled)) for _ in range(ROUNDS)]
    return min(e for e, _ in runs) / min(c for _, c in runs)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", default="B", choices=("A", "B"))
    ap.add_argument("--trials", type=int, default=6)
    a = ap.parse_args()
    over = MODELS[a.model]["over"] | {"train.device": "cpu", "train.precision": "bf16"}
    for flag, value in zip(MODELS[a.model]["args"][::2], MODELS[a.model]["args"][1::2]):
        if flag != "--preset":
            over[flag.removeprefix("--")] = value
    cfg = load_config(MODELS[a.model]["preset"], overrides=over | {"train.compile": "none"})
    cpu = torch.device("cpu")
    built = build(cfg, cpu, with_data=False)
    batch = compile_module.trial_batch(cfg, built.model.vocab_size, cpu)
    autocast = lambda: built.resolved.precision.autocast(cpu)  # noqa: E731

    def timed(fn) -> float:
        return compile_module._timed(fn, built.model, batch, autocast, cpu)

    eager = built.loss_fn
    compiled = torch.compile(eager)
    timed(eager)
    compile_s = timed(compiled)
    ratios: dict[str, list[float]] = {"in a row": [], "alternated": []}
    for t in range(a.trials):
        for name, trial in (("in a row", in_a_row), ("alternated", alternated)):
            ratios[name].append(trial(timed, eager, compiled))
            print(f"trial {t + 1} {name}: eager / compiled {ratios[name][-1]:.3f}", flush=True)
    lines = [
        f"# Spread of the compile trial's eager / compiled ratio: model {a.model}",
        "",
        f"`python benchmarks/compile_trial_spread.py --model {a.model} --trials {a.trials}`; "
        f"CPU bf16: {bf16_kind()}, {torch.get_num_threads()} threads, torch {torch.__version__}; "
        f"{time.strftime('%Y-%m-%d')}; bf16, `default` compile (first run, compile included: "
        f"{compile_s:.1f} s), trials interleaved.",
        "",
        "| trial kind | micro-batches a trial | ratios | median | max - min | stdev |",
        "|---|---|---|---|---|---|",
    ]
    for name, rs in ratios.items():
        runs = 4 if name == "in a row" else 2 * ROUNDS
        lines.append(
            f"| {name} | {runs} | {', '.join(f'{r:.3f}' for r in rs)} | "
            f"{statistics.median(rs):.3f} | {max(rs) - min(rs):.3f} | {statistics.stdev(rs):.3f} |"
        )
    write_result(f"compile-trial-spread-{a.model}", lines, show=True)


if __name__ == "__main__":
    main()
