"""Several processes equal one: the parity and per-process memory tables of docs/distributed.md.

    python benchmarks/distributed_parity.py [--preset small] [--steps 20]

Launches `onegpu train` as one process, then under `torchrun --nproc-per-node 2` with DDP,
FSDP2, FSDP2 with `reshard_after_forward false` and FSDP2 with `cpu_offload` (gloo on this
CPU; nccl on GPUs), on the same global batch, and writes benchmarks/results/distributed-parity
.{json,md}: the per-step losses against the single process's, and each process's measured
parameter + optimizer bytes against `onegpu plan --world-size 2`'s prediction.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
from pathlib import Path

from onegpu.config import load_config
from onegpu.plan.report import plan_report

RESULTS = Path(__file__).parent / "results"
CONTESTANTS = {
    "1 process": (1, {}),
    "DDP, 2 processes": (2, {"dist.strategy": "ddp"}),
    "FSDP2, 2 processes": (2, {"dist.strategy": "fsdp"}),
    "FSDP2, reshard_after_forward false": (2, {"dist.strategy": "fsdp",
                                               "dist.reshard_after_forward": "false"}),
    "FSDP2, cpu_offload": (2, {"dist.strategy": "fsdp", "dist.cpu_offload": "true"}),
}  # fmt: skip


def threads_each(nproc: int) -> str:
    """The cores shared out: each of `nproc` processes runs with this many threads."""
    return str(max(1, (os.cpu_count() or 1) // nproc))


def run(out: Path, nproc: int, values: dict[str, str]) -> dict:
    args = [f"--{k}={v}" for k, v in values.items()] + [f"--out.dir={out}"]
    head = [sys.executable, "-m", "onegpu", "train"]
    if nproc > 1:
        head = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                f"--nproc-per-node={nproc}", "-m", "onegpu", "train"]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": threads_each(nproc)}
    subprocess.run(head + args, check=True, env=env, capture_output=True, text=True)
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    return {
        "losses": [r["loss"] for r in rows if "loss" in r],
        "summary": json.loads((out / "summary.json").read_text()),
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="small")
    ap.add_argument("--steps", type=int, default=20)
    a = ap.parse_args()
    values = {"preset": a.preset, "train.max_steps": str(a.steps), "train.batch_size": "16",
              "train.micro_batch_size": "4", "train.log_every": "1", "train.eval_every": "0",
              "train.device": "cpu", "train.precision": "fp32", "out.progress": "false",
              "train.measure_memory": "false"}  # fmt: skip
    preset = values.pop("preset")
    cfg = load_config(preset, overrides=values)
    os.environ["OMP_NUM_THREADS"] = threads_each(2)  # the plan times with the runs' threads
    planned = plan_report(cfg, None, None, world_size=2)["memory"]
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, (nproc, extra) in CONTESTANTS.items():
            out = Path(tmp) / name.replace(" ", "_").replace(",", "")
            results[name] = run(out, nproc, {"preset": preset, **values, **extra})
            print(name, "done", flush=True)
    base = results["1 process"]["losses"]
    table = []
    for name, r in results.items():
        rel = max(abs(x - y) / abs(y) for x, y in zip(r["losses"], base, strict=True))
        s = r["summary"]
        per = s.get("dist", {}).get("per_rank", [])
        table.append({
            "contestant": name, "final_loss": r["losses"][-1], "max_rel_loss_diff": rel,
            "tokens_per_s": s["tokens_per_s"],
            "param_plus_optimizer_bytes_per_rank": [p["param_bytes"] + p["optimizer_bytes"] for p in per],
            "peak_rss_per_rank": [p["peak_mem_bytes"] for p in per] or [s["peak_mem_bytes"]],
        })  # fmt: skip
    single_bytes = None
    doc = {
        "command": "python benchmarks/distributed_parity.py " + " ".join(sys.argv[1:]),
        "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
        "gloo, torch " + results["1 process"]["summary"]["torch"],
        "preset": preset,
        "steps": a.steps,
        "planned_rank0_param_plus_optimizer_bytes": planned["params"] + planned["optimizer"],
        "planned_rank0": planned,
        "rows": table,
    }
    single_plan = plan_report(cfg, None, None)["memory"]
    single_bytes = single_plan["params"] + single_plan["optimizer"]
    doc["planned_single_param_plus_optimizer_bytes"] = single_bytes
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "distributed-parity.json").write_text(json.dumps(doc, indent=1) + "\n")
    lines = [f"# 1 process vs DDP vs FSDP2 ({preset}, {a.steps} steps, global batch 16 x "
             f"{cfg.train_seq_len}, micro-batch 4)", "", f"`{doc['command']}` on {doc['machine']}",
             "", "| contestant | final loss | max relative loss difference vs 1 process | "
             "tokens/s | parameter + optimizer bytes per process (measured) | peak RSS per process |",
             "|---|---|---|---|---|---|"]  # fmt: skip
    for t in table:
        mine = ", ".join(f"{b / 2**20:.2f} MiB" for b in t["param_plus_optimizer_bytes_per_rank"])
        rss = ", ".join(f"{b / 2**20:,.0f} MiB" for b in t["peak_rss_per_rank"])
        lines.append(f"| {t['contestant']} | {t['final_loss']:.5f} | {t['max_rel_loss_diff']:.1e} | "
                     f"{t['tokens_per_s']:,.0f} | {mine or '-'} | {rss} |")  # fmt: skip
    lines += ["", f"Planned (`onegpu plan --world-size 2`), rank 0: parameters + optimizer "
              f"{doc['planned_rank0_param_plus_optimizer_bytes'] / 2**20:.2f} MiB; one process: "
              f"{single_bytes / 2**20:.2f} MiB."]  # fmt: skip
    (RESULTS / "distributed-parity.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
