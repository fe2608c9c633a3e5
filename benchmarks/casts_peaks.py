"""The planned peak with autocast's weight copies held over a step's micro-batches, and without.

    python benchmarks/casts_peaks.py

Each config is planned twice (`plan_memory`: fake tensors through the real `TrainStep`), with
`reuses_casts` forced off and on, beside what the rule decides for it: the rule must hold the
copies only where holding them leaves the peak where it was. Writes
results/casts-peaks-<date>.md (never over an earlier file).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import onegpu.backends.torch.build as build_module
from onegpu.backends.torch.step import reuses_casts
from onegpu.config import load_config
from onegpu.distributed import single_process
from onegpu.plan.memory import plan_memory

sys.path.insert(0, str(Path(__file__).parent))
from records import bf16_kind, write_result  # noqa: E402

B = {"model.n_layer": "6", "model.d_model": "384", "model.n_head": "6", "model.seq_len": "256",
     "model.vocab_size": "8192", "data.tokenizer": "bpe"}  # fmt: skip
CONFIGS: dict[str, tuple[str, dict[str, str]]] = {
    "A: seed-ref, batch 8, micro-batch 2": ("seed-ref", {"train.micro_batch_size": "2"}),
    "seed-ref, micro-batch 1, seq 512": ("seed-ref", {"train.micro_batch_size": "1"}),
    "seed-ref, micro-batch 1, seq 256": (
        "seed-ref",
        {"train.micro_batch_size": "1", "model.seq_len": "256"},
    ),
    "seed-ref, micro-batch 1, seq 128": (
        "seed-ref",
        {"train.micro_batch_size": "1", "model.seq_len": "128"},
    ),
    "B, batch 16, micro-batch 4": ("small", B | {"train.batch_size": "16"}),
    "small, batch 16, micro-batch 4": ("small", {"train.batch_size": "16"}),
    "tiny, micro-batch 4": ("tiny", {}),
    "tiny, micro-batch 1, seq 16": ("tiny", {"train.micro_batch_size": "1", "model.seq_len": "16"}),
    "tiny, block checkpointing": ("tiny", {"memory.checkpointing": "block"}),
}
BASE = {"train.device": "cpu", "train.precision": "bf16", "train.compile": "none",
        "model.dropout": "0.0", "train.batch_size": "8", "train.micro_batch_size": "4"}  # fmt: skip


def peaks(preset: str, over: dict[str, str]) -> tuple[bool, int, int]:
    """(the rule's choice, the planned peak casting in each micro-batch, holding the copies)."""
    cfg = load_config(preset, overrides=BASE | over)
    rule = reuses_casts(cfg, single_process())
    planned = []
    for held in (False, True):
        build_module.reuses_casts = lambda cfg, dist, held=held: held
        try:
            planned.append(plan_memory(cfg, "cpu").memory["peak"])
        finally:
            build_module.reuses_casts = reuses_casts
    return rule, planned[0], planned[1]


def main() -> None:
    lines = [
        "# Planned peak with autocast's weight copies held over a step's micro-batches",
        "",
        f"`python benchmarks/casts_peaks.py`; CPU plan, bf16, eager; CPU bf16: {bf16_kind()}; "
        f"{time.strftime('%Y-%m-%d')}. 'rule': what `reuses_casts` decides.",
        "",
        "| config | rule | peak, cast each micro-batch | peak, copies held | change |",
        "|---|---|---|---|---|",
    ]
    for name, (preset, over) in CONFIGS.items():
        rule, off, on = peaks(preset, over)
        choice = "hold" if rule else "cast again"
        lines.append(f"| {name} | {choice} | {off:,} | {on:,} | {on / off - 1:+.2%} |")
        print(lines[-1], flush=True)
    write_result("casts-peaks", lines)


if __name__ == "__main__":
    main()
