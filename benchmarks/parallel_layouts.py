"""The memory-footprint survey's comparison of parallel layouts, run and planned.

Gusak et al. ("Survey on Efficient Training of Large Neural Networks", IJCAI 2022) tabulate
data, model (tensor) and pipeline parallelism, ZeRO partitioning and gradient compression by
memory per device, communication per step and compute overhead. This reproduces the table:

1. **Run** on this CPU's processes (gloo): every layout of the same model, batch and steps,
   launched with torchrun as a user would; per rank the measured peak (`train.measure_memory`:
   the allocator's events of the step replayed), the planner's prediction for that rank and
   its error, the bytes each mesh dimension sends per step (plan/links.py), tokens/s, and the
   final loss against one process's.
2. **Planned** for 8 GPUs: a Llama-3-8B-sized onegpu GPT (d_model 4096, 32 blocks, 32 heads,
   vocabulary 128,256, untied: 7.5B parameters) on H100-80s over NVLink, each layout's largest
   rank, its bytes per step and predicted step time.
3. **PowerSGD** against DDP's plain all-reduce over 200 steps: bytes sent and the loss paid.

    python benchmarks/parallel_layouts.py [--steps 20] [--skip-planned] [--skip-powersgd]

Writes benchmarks/results/parallel-layouts-<date>.md (a new file each run).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from records import bf16_kind, write_result

from onegpu.config import load_config
from onegpu.config.layout import resolve_layout
from onegpu.plan import links
from onegpu.plan.report import plan_report

MODEL = {
    "model.n_layer": 4,
    "model.d_model": 256,
    "model.n_head": 8,
    "model.seq_len": 256,
    "model.tie_embeddings": "false",
    "model.dropout": 0,
    "train.batch_size": 16,
    "train.micro_batch_size": 4,
    "train.precision": "fp32",
    "train.eval_every": 0,
    "train.log_every": 1,
    "train.measure_memory": "true",
    "checkpoint.every": 0,
    "out.progress": "false",
}
RUN_LAYOUTS = {
    "one process": (1, {}),
    "DP (DDP)": (2, {"dist.strategy": "ddp"}),
    "FSDP (ZeRO-3)": (2, {"dist.strategy": "fsdp"}),
    "HSDP 2 x 2": (4, {"dist.dp_replicate": 2, "dist.dp_shard": 2}),
    "TP 2": (2, {"dist.tp": 2}),
    "PP 2 (1F1B)": (2, {"dist.pp": 2}),
    "TP 2 x FSDP 2": (4, {"dist.tp": 2, "dist.dp_shard": 2}),
    "PP 2 x FSDP 2": (4, {"dist.pp": 2, "dist.dp_shard": 2}),
}
LLAMA_SIZED = {
    "model.n_layer": 32,
    "model.d_model": 4096,
    "model.n_head": 32,
    "model.vocab_size": 128256,
    "model.seq_len": 2048,
    "model.tie_embeddings": "false",
    "model.dropout": 0,
    "train.batch_size": 32,
    "train.micro_batch_size": 1,
    "train.precision": "bf16",
    "memory.checkpointing": "block",
}
PLANNED_LAYOUTS = {
    "DP (DDP) 8": {"dist.strategy": "ddp"},
    "FSDP 8": {"dist.strategy": "fsdp"},
    "HSDP 2 x 4": {"dist.dp_replicate": 2, "dist.dp_shard": 4},
    "TP 8": {"dist.tp": 8, "dist.dp_shard": 1},
    "PP 8 (1F1B)": {"dist.pp": 8, "dist.dp_shard": 1},
    "TP 2 x FSDP 4": {"dist.tp": 2, "dist.dp_shard": 4},
    "PP 2 x FSDP 4": {"dist.pp": 2, "dist.dp_shard": 4},
}
MIB, GIB = 2**20, 2**30


def launch(out: Path, nproc: int, over: dict) -> dict:
    args = ["--preset", "tiny", *(f"--{k}={v}" for k, v in over.items()), f"--out.dir={out}"]
    if nproc == 1:
        cmd = [sys.executable, "-m", "onegpu", "train", *args]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               f"--nproc-per-node={nproc}", "-m", "onegpu", "train", *args]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    subprocess.run(cmd, check=True, capture_output=True, text=True, env=env)
    return json.loads((out / "summary.json").read_text())


def planned_peaks(over: dict, nproc: int) -> dict[int, int]:
    """{rank: planned peak bytes} for the ranks the planner follows (one per stage)."""
    cfg = load_config("tiny", overrides={k: str(v) for k, v in over.items()})
    report = plan_report(cfg, None, None, nproc)
    if "ranks" in report.get("dist", {}):
        return {r["rank"]: r["memory"]["peak"] for r in report["dist"]["ranks"]}
    return {0: report["memory"]["peak"]}


def sent_per_step(over: dict, nproc: int, params: int) -> dict[str, int]:
    cfg = load_config("tiny", overrides={k: str(v) for k, v in over.items()})
    layout = resolve_layout(cfg.dist, nproc)
    compute_bytes = 2 if cfg.train.precision in ("bf16", "bf16-pure", "fp16") else 4
    shape = links.step_shape(cfg, layout, params, compute_bytes)
    ddp = params * 4
    return links.bytes_per_step(layout, shape, reshard=True, ddp_sent=ddp, interleaved=False)


def run_table(steps: int, root: Path) -> list[str]:
    rows = [
        "| layout | processes | rank: measured peak MiB (planned, error) | sent per step per "
        "process MiB | tokens/s | final loss (vs one process) |",
        "|---|---|---|---|---|---|",
    ]
    single_loss = None
    for name, (nproc, layout) in RUN_LAYOUTS.items():
        over = {**MODEL, "train.max_steps": steps, **layout}
        summary = launch(root / name.replace(" ", "_"), nproc, over)
        planned = planned_peaks(over, nproc)
        per_rank = summary["dist"]["per_rank"] if "dist" in summary else [
            {"rank": 0, "memory": summary["memory"]}
        ]  # fmt: skip
        cells = []
        for r in per_rank:
            measured = r["memory"]["peak"]
            plan = planned.get(r["rank"])
            if plan is None:
                continue  # a rank the planner does not follow (same stage as one it does)
            cells.append(
                f"{r['rank']}: {measured / MIB:.1f} ({plan / MIB:.1f}, {plan / measured - 1:+.0%})"
            )
        sent = sent_per_step(over, nproc, summary["params"]) if nproc > 1 else {}
        loss = summary["loss"]
        single_loss = single_loss or loss
        rows.append(
            f"| {name} | {nproc} | {'; '.join(cells)} | "
            + (", ".join(f"{k} {v / MIB:.1f}" for k, v in sent.items()) or "-")
            + f" | {summary['tokens_per_s']:,.0f} | {loss:.5f} "
            f"({abs(loss - single_loss) / single_loss:.1e}) |"
        )
        print(rows[-1], flush=True)
    rows += [
        "",
        f"{summary['params']:,} parameters. Peak: `train.measure_memory`'s (what existed "
        "before the step plus the most the step held at once, replayed from the allocator's "
        "events; buffers gloo's threads free, which the profiler never sees freed, left out: "
        "memory/breakdown.py); planned: `onegpu plan --world-size N` for the same config (one "
        "rank per pipeline stage). Sent: plan/links.py's count.",
    ]
    return rows


def planned_table() -> list[str]:
    rows = [
        "| layout | largest rank's peak GiB | fits H100-80 | sent per step per process GiB "
        "(tp / dp_shard / dp_replicate / pp) | predicted step s | tokens/s |",
        "|---|---|---|---|---|---|",
    ]
    for name, layout in PLANNED_LAYOUTS.items():
        cfg = load_config(
            "tiny", overrides={k: str(v) for k, v in {**LLAMA_SIZED, **layout}.items()}
        )
        r = plan_report(cfg, "H100-80", None, 8)
        d = r.get("dist", {})
        sent = d.get("bytes_per_step") or sent_per_step({**LLAMA_SIZED, **layout}, 8, r["params"])
        step = d.get("predicted_step_time_s")
        if step is None:  # plain DDP / FSDP: compute, and what it sends, timed the same way
            step = links.step_seconds(r["predicted_compute_s"], links.seconds(sent, "nvlink"), 0.0)
        tps = cfg.train.batch_size * cfg.train_seq_len / step
        rows.append(
            f"| {name} | {r['memory']['peak'] / GIB:.1f} | {'yes' if r.get('fits') else 'no'} | "
            + " / ".join(
                f"{sent.get(k, 0) / GIB:.2f}" for k in ("tp", "dp_shard", "dp_replicate", "pp")
            )
            + f" | {step:.2f} | {tps:,.0f} |"
        )
        print(rows[-1], flush=True)
    return rows


def powersgd_table(root: Path, steps: int = 200) -> list[str]:
    rows = [
        "| all-reduce | sent per step per process MiB | final loss | vs plain |",
        "|---|---|---|---|",
    ]
    base = None
    for spec in ("none", "bf16", "powersgd:4", "powersgd:1"):
        over = {**MODEL, "train.max_steps": steps, "train.measure_memory": "false",
                "dist.strategy": "ddp", "dist.grad_compression": spec, "train.log_every": 10}  # fmt: skip
        summary = launch(root / f"ddp-{spec.replace(':', '-')}", 2, over)
        d = summary["dist"]
        base = base or summary["loss"]
        rows.append(
            f"| {spec} | {d['allreduce_bytes_per_step'] / MIB:.2f} (of "
            f"{d['uncompressed_bytes_per_step'] / MIB:.2f}) | {summary['loss']:.4f} | "
            f"{summary['loss'] / base - 1:+.2%} |"
        )
        print(rows[-1], flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--skip-planned", action="store_true")
    ap.add_argument("--skip-powersgd", action="store_true")
    args = ap.parse_args()
    cpu = bf16_kind()
    lines = [
        f"# Parallel layouts ({datetime.date.today()})",
        "",
        f"Machine: {os.cpu_count()}-core CPU ({cpu}), gloo, torch processes of one thread each.",
        f"Command: `python benchmarks/parallel_layouts.py --steps {args.steps}`",
        "",
        f"## Run on this CPU: a 4 x d256 GPT, batch 16 x 256, {args.steps} steps, fp32",
        "",
    ]
    with tempfile.TemporaryDirectory() as tmp:
        lines += run_table(args.steps, Path(tmp))
        if not args.skip_planned:
            lines += ["", "## Planned: a Llama-3-8B-sized GPT on 8 H100-80 over NVLink "
                      "(bf16, block checkpointing, batch 32 x 2048, micro-batch 1)", ""]  # fmt: skip
            lines += planned_table()
        if not args.skip_powersgd:
            lines += ["", "## PowerSGD against DDP's plain all-reduce, 2 processes, 200 steps", ""]
            lines += powersgd_table(Path(tmp))
    write_result("parallel-layouts", lines)


if __name__ == "__main__":
    main()
