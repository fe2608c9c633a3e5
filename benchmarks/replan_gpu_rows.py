"""Plan a GPU run's memory rows again with today's planner, on this CPU, against what the GPU measured.

A GPU lease is rare; a planner change that a GPU run's measurements can judge should not wait
for the next one. This reads a `benchmarks/gpu_suite.py` result (.json), plans each memory row
for the same GPU with the same overrides (`onegpu plan --gpu ... --json`, in this process), and
writes measured, planned then and planned now side by side.

Usage: python benchmarks/replan_gpu_rows.py benchmarks/results/gpu-nvidia-h200-2026-11-28-2.json
"""

from __future__ import annotations

import argparse
import json
import platform
import tempfile
from pathlib import Path

import torch
from gpu_suite import GPT2, _overrides
from records import bf16_kind, commit_of, write_result

from onegpu.config import load_config
from onegpu.plan.report import plan_report

GiB = 2**30


def replan(row: dict, gpu: str, work: Path, loss_chunk: str | None) -> dict:
    preset, over = _overrides(GPT2, row["overrides"], work)
    assert preset == row["preset"], (preset, row["preset"])
    ran = row.get("kernels") or row.get("kernels_apart", {}).get("run", {})
    chunk = loss_chunk or ran.get("loss_chunk")  # the run's choice, where its row says
    if chunk is not None and "memory.loss_chunk" not in row["overrides"]:
        over["memory.loss_chunk"] = str(chunk)
    report = plan_report(load_config(preset, overrides=over), gpu, None)
    return {"peak": report["memory"]["peak"], "loss_chunk": report["config"]["loss_chunk"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run", type=Path, help="a gpu_suite .json result")
    parser.add_argument(
        "--loss-chunk",
        help="the loss chunk the run's `auto` chose, where its result does not record it "
        "(default: the run's record, else what a plan on this CPU takes)",
    )
    args = parser.parse_args()
    run = json.loads(args.run.read_text())
    gpu, env = run["planned_for"], run["environment"]
    lines = [
        f"# {env['device']}'s memory rows of {env['date']}, planned again ({gpu})",
        "",
        f"`python benchmarks/replan_gpu_rows.py {args.run}"
        + (f" --loss-chunk {args.loss_chunk}" if args.loss_chunk else "")
        + "`; planned on this CPU "
        f"({platform.machine()}, {bf16_kind()}, torch {torch.__version__}, onegpu at "
        f"{commit_of(Path(__file__).parent)}). Measured: `torch.cuda.max_memory_allocated` of the "
        f"run's 4-step `onegpu train` on the {env['device']} (torch {env['torch']}).",
        "",
        *(
            [
                f"Every row's loss chunk is {args.loss_chunk}, given on the command line: the "
                "run's result does not record what its `auto` chose (results since 2026-11-29 "
                "do, under `kernels`). A row whose micro-batch has no more tokens than that "
                "runs it as one chunk.",
                "",
            ]
            if args.loss_chunk
            else []
        ),
        "| configuration | measured GiB | planned then | error then | planned now | error now "
        "| loss chunk now |",
        "|---|---|---|---|---|---|---|",
    ]
    with tempfile.TemporaryDirectory() as tmp:
        for row in run["memory"]:
            if "measured_peak" not in row or "planned_peak" not in row:
                continue
            now = replan(row, gpu, Path(tmp), args.loss_chunk)
            measured, then = row["measured_peak"], row["planned_peak"]
            lines.append(
                f"| {row['name']} | {measured / GiB:.2f} | {then / GiB:.2f} | "
                f"{then / measured - 1:+.1%} | {now['peak'] / GiB:.2f} | "
                f"{now['peak'] / measured - 1:+.1%} | {now['loss_chunk']} |"
            )
            print(lines[-1], flush=True)
    write_result("replan-" + args.run.stem, lines)


if __name__ == "__main__":
    main()
