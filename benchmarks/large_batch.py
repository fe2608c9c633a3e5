"""Large-batch training: AdamW against LAMB (and LARS) at equal tokens, batch 16 -> 256.

The memory-footprint survey (Gusak et al.) lists large-batch training (LARS, LAMB) as the way
to use the memory the other techniques free: a batch 16x larger takes 16x fewer steps, and a
layer-wise trust ratio is meant to keep the loss where a small batch would have it. Each run
here sees the same tokens (the same data order), with the learning rate scaled from batch 16 by
the square root of the batch ratio (`--optim.lr_scaling sqrt --optim.base_batch 16`, the LAMB
paper's rule) and warmup over the same number of sequences (Goyal et al.: a fixed share of the
data, so fewer steps at a larger batch).

    python benchmarks/large_batch.py [--tokens 2000000]

Writes benchmarks/results/large-batch-<date>.md (a new file each run).
"""

from __future__ import annotations

import argparse
import datetime
import os
import tempfile
import time
from pathlib import Path

from records import bf16_kind, write_result

from onegpu.config import load_config
from onegpu.train import train

MODEL = {
    "model.n_layer": "4",
    "model.d_model": "128",
    "model.n_head": "4",
    "model.seq_len": "128",
    "model.dropout": "0",
    "train.device": "cpu",
    "train.precision": "fp32",
    "checkpoint.every": "0",
    "out.progress": "false",
    "train.log_every": "10",
    "train.compile": "none",  # the same eager step for every run (no timed compile trials)
}
BASE_LR = {"adamw": 1e-3, "lamb": 1e-2, "lars": 1.0}
BATCHES = (16, 64, 256)
WARMUP_SEQUENCES = 16 * 20  # 20 steps at batch 16


def run(name: str, batch: int, tokens: int, out: Path) -> dict:
    steps = tokens // (batch * int(MODEL["model.seq_len"]))
    over = {
        **MODEL,
        "optim.name": name,
        "optim.lr": str(BASE_LR[name]),
        "optim.lr_scaling": "sqrt",
        "optim.base_batch": "16",
        "optim.warmup_steps": str(max(1, WARMUP_SEQUENCES // batch)),
        "train.batch_size": str(batch),
        "train.micro_batch_size": str(min(batch, 64)),
        "train.max_steps": str(steps),
        "train.eval_every": str(steps),
        "out.dir": str(out),
    }
    t0 = time.perf_counter()
    summary = train(load_config("tiny", overrides=over))
    summary["seconds"] = time.perf_counter() - t0
    summary["steps_run"] = steps
    return summary


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=2_000_000)
    ap.add_argument("--optimizers", default="adamw,lamb,lars")
    args = ap.parse_args()
    names = args.optimizers.split(",")
    lines = [
        f"# Large-batch training at equal tokens ({datetime.date.today()})",
        "",
        f"Machine: {os.cpu_count()}-core CPU ({bf16_kind()}), fp32. Model: 4 x d128 GPT, "
        f"seq 128, byte tokens; {args.tokens:,} training tokens per run, the same data order. "
        "Learning rate scaled by sqrt(batch / 16) from the base (AdamW 1e-3, LAMB 1e-2, LARS "
        "1.0); warmup over 320 sequences.",
        f"Command: `python benchmarks/large_batch.py --tokens {args.tokens} --optimizers "
        f"{args.optimizers}`",
        "",
        "| batch | steps | " + " | ".join(f"{n} val loss" for n in names) + " |",
        "|---|---|" + "---|" * len(names),
    ]
    with tempfile.TemporaryDirectory() as tmp:
        for batch in BATCHES:
            cells, steps = [], 0
            for name in names:
                s = run(name, batch, args.tokens, Path(tmp) / f"{name}-{batch}")
                steps = s["steps_run"]
                cells.append(f"{s.get('val_loss', s['loss']):.4f}")
                print(name, batch, cells[-1], f"{s['seconds']:.0f} s", flush=True)
            lines.append(f"| {batch} | {steps} | " + " | ".join(cells) + " |")
    write_result("large-batch", lines, show=True)


if __name__ == "__main__":
    main()
