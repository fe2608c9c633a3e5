"""Checkpointing by budget against the uniform policies, at equal peak: Rotor's claim tested.

Rotor (Beaumont et al., 2019) finds, for a memory budget, the checkpointing schedule of least
recomputation, and reports large memory savings for a small time overhead. Here, for models A
and B of the project's head-to-head (A: `seed-ref`, vocabulary 50,257, seq 512, batch 8; B: 6 x
d384, vocabulary 8,192, seq 256, batch 16; both fp32, no dropout, eager,
the loss in chunks of 1,024 rows so that the logits do not hide the blocks):

1. each uniform policy (none, selective, attn+mlp, block) runs: measured peak (the allocator's
   tracked peak of a step) and median steady step time;
2. `budget:B` with B half-way between two neighbouring uniform policies' planned peaks runs
   the per-block mix it decides: against the leaner uniform policy (the one that would have to
   be taken to fit B), what it saves in time, and what it holds;
3. planned only, a 1B-class GPT on an RTX 4090 (seq 2048, micro-batch 8, bf16): each uniform
   policy's planned peak and predicted step, and the budgets between them.

    python benchmarks/budget_checkpointing.py [--steps 10] [--skip-measured]

Writes benchmarks/results/budget-checkpointing-<date>.md (a new file each run). One fresh
process per row, rows in sequence, one round: nothing else should run meanwhile.
"""

from __future__ import annotations

import argparse
import os
import tempfile
from pathlib import Path

from records import bf16_kind, write_result

from onegpu.config import load_config, with_overrides
from onegpu.perf.flops import recompute_factor
from onegpu.plan.budget import plan_budget
from onegpu.plan.memory import plan_memory
from onegpu.plan.report import plan_report
from onegpu.tools.bench import run_row

MODELS = {
    "A": ("seed-ref", {"model.dropout": "0", "train.batch_size": "8", "train.micro_batch_size": "8"}),
    "B": ("small", {"model.n_layer": "6", "model.d_model": "384", "model.n_head": "6",
                    "model.seq_len": "256", "model.vocab_size": "8192", "data.tokenizer": "bpe",
                    "model.dropout": "0", "train.batch_size": "16",
                    "train.micro_batch_size": "16"}),
}  # fmt: skip
COMMON = {"train.precision": "fp32", "train.compile": "none", "train.device": "cpu",
          "memory.loss_chunk": "1024"}  # fmt: skip
UNIFORM = ("none", "selective", "attn+mlp", "block")
ONE_B = {"model.n_layer": "16", "model.d_model": "2048", "model.n_head": "16",
         "model.vocab_size": "32000", "model.seq_len": "2048", "model.dropout": "0",
         "model.tie_embeddings": "false", "train.batch_size": "8",
         "train.micro_batch_size": "8", "train.precision": "bf16"}  # fmt: skip
MIB, GIB = 2**20, 2**30


def measured_table(name: str, steps: int, workdir: Path) -> list[str]:
    preset, over = MODELS[name]
    over = {**COMMON, **over}
    cfg = load_config(preset, overrides=over)
    rows = [
        f"### Model {name}",
        "",
        "| checkpointing | runs as | planned peak MiB | measured peak MiB | step ms | "
        "recompute (counted) |",
        "|---|---|---|---|---|---|",
    ]
    planned = {}
    for policy in UNIFORM:
        planned[policy] = plan_memory(with_overrides(cfg, {"memory.checkpointing": policy}))
        rows.append(
            _row(policy, policy, planned[policy].memory["peak"], preset, over, steps, workdir)
        )
        print(rows[-1], flush=True)
    for hi, lo in zip(UNIFORM, UNIFORM[1:], strict=False):
        budget = (planned[hi].memory["peak"] + planned[lo].memory["peak"]) // 2
        budgeted = with_overrides(cfg, {"memory.checkpointing": f"budget:{budget}"})
        _, decided = plan_budget(budgeted, "cpu", None, None)
        label = f"budget {budget / MIB:,.1f} MiB (between {hi} and {lo})"
        rows.append(
            _row(
                label,
                decided["checkpointing"],
                decided["planned_peak"],
                preset,
                over,
                steps,
                workdir,
            )
        )
        print(rows[-1], flush=True)
    return rows


def _row(label, mode, planned, preset, over, steps, workdir) -> str:
    r = run_row(preset, None, {**over, "memory.checkpointing": mode}, steps, workdir)
    return (
        f"| {label} | {mode} | {planned / MIB:,.1f} | {r['peak_mem_bytes'] / MIB:,.1f} | "
        f"{r['step_time_s'] * 1e3:,.0f} | {recompute_factor(mode):.3f} |"
    )


def planned_table() -> list[str]:
    cfg = load_config("tiny", overrides=ONE_B)
    rows = [
        "### Planned: a 1B-class GPT on an RTX 4090 (16 x d2048, vocabulary 32,000, seq 2048, "
        "micro-batch 8, bf16 autocast, AdamW)",
        "",
        "| checkpointing | runs as | planned peak GiB | predicted step s |",
        "|---|---|---|---|",
    ]
    peaks = {}
    for policy in UNIFORM:
        r = plan_report(with_overrides(cfg, {"memory.checkpointing": policy}), "RTX4090", None)
        peaks[policy] = r["memory"]["peak"]
        rows.append(
            f"| {policy} | {policy} | {peaks[policy] / GIB:.2f} | "
            f"{r['predicted_step_time_s']:.2f} |"
        )
    for hi, lo in zip(UNIFORM, UNIFORM[1:], strict=False):
        budget = (peaks[hi] + peaks[lo]) // 2
        r = plan_report(
            with_overrides(cfg, {"memory.checkpointing": f"budget:{budget}"}), "RTX4090", None
        )
        b = r["checkpointing_budget"]
        rows.append(
            f"| budget {budget / GIB:.2f} GiB (between {hi} and {lo}) | {b['checkpointing']} | "
            f"{b['planned_peak'] / GIB:.2f} | {r['predicted_step_time_s']:.2f} |"
        )
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--skip-measured", action="store_true", help="the planned table only")
    args = ap.parse_args()
    lines = [
        "# Checkpointing by budget against the uniform policies",
        "",
        f"Machine: {os.cpu_count()}-core CPU ({bf16_kind()}), fp32, eager, one process per row "
        f"({args.steps} steps, the median of the steps after the third).",
        f"Command: `python benchmarks/budget_checkpointing.py --steps {args.steps}"
        + (" --skip-measured`" if args.skip_measured else "`"),
        "",
    ]
    with tempfile.TemporaryDirectory() as tmp:
        for name in MODELS if not args.skip_measured else ():
            lines += measured_table(name, args.steps, Path(tmp)) + [""]
    lines += planned_table()
    write_result("budget-checkpointing", lines, show=True)


if __name__ == "__main__":
    main()
