"""Memory techniques on the reference model of "Optimising the Training Loop" (preset seed-ref): none, each alone, the best combinations.

Usage:
  python benchmarks/memory_ablation.py                       # seed-ref grid (about 30 min here)
  python benchmarks/memory_ablation.py --grid larger         # a 124M GPT-2 at seq 512
  python benchmarks/memory_ablation.py --only none,bf16 --steps 4   # re-measure rows in place

Each configuration runs `onegpu train` in its own process (on CPU the process peak RSS is a
lifetime maximum, so configurations must not share a process) and reads its run folder:
- peak: tensor bytes allocated at the step's peak, from the profiler's memory timeline of the
  second step (summary.json `memory`), split into params/grads/optimizer/activations/other;
- saved: saved-activation bytes of one micro-batch, counted exactly with saved_tensors_hooks;
- RSS: the process's peak resident memory (interpreter and libraries included);
- step time: median over the steps after the third (the first warms up, the second is the
  profiled one, the third pays for the profiler's teardown), and tokens/s from it
  (the committed tables were measured with --steps 5 and the median of steps 3..5);
- loss: the training loss of the last step (same data order and initialisation in every row).
Writes NAME.md and NAME.json under --out-dir.
"""

from __future__ import annotations

import argparse
import json
import platform
import shlex
import sys
import tempfile
import time
from pathlib import Path

import torch

from onegpu.tools.bench import run_row

BASE = {  # that post's naive loop: full batch in one pass, fp32, AdamW
    "train.precision": "fp32",
    "train.micro_batch_size": "32",
}
GRIDS: dict[str, dict] = {
    "seed-ref": {
        "preset": "seed-ref",
        "base": BASE,
        "rows": [
            ("none", {}),
            ("accumulation x4", {"train.micro_batch_size": "8"}),
            ("bf16 autocast", {"train.precision": "bf16"}),
            ("bf16-pure", {"train.precision": "bf16-pure"}),
            ("checkpoint attn+mlp", {"memory.checkpointing": "attn+mlp"}),
            ("checkpoint block", {"memory.checkpointing": "block"}),
            ("checkpoint selective", {"memory.checkpointing": "selective"}),
            ("offload activations", {"memory.offload_activations": "true"}),
            ("chunked loss 2048", {"memory.loss_chunk": "2048"}),
            ("gelu 2-bit", {"memory.gelu_bits": "2"}),
            ("randomized linear 0.5", {"memory.randomized_linear": "0.5"}),
            ("adamw8bit", {"optim.name": "adamw8bit"}),
            ("adafactor", {"optim.name": "adafactor", "optim.lr": "1e-2"}),
            ("optimizer in backward", {"optim.in_backward": "true", "optim.grad_clip": "0"}),
            (
                "best fast: bf16 + selective + chunked loss",
                {
                    "train.precision": "bf16",
                    "memory.checkpointing": "selective",
                    "memory.loss_chunk": "2048",
                },
            ),
            (
                "best exact: bf16 + accum x4 + block + chunked loss",
                {
                    "train.precision": "bf16",
                    "train.micro_batch_size": "8",
                    "memory.checkpointing": "block",
                    "memory.loss_chunk": "2048",
                },
            ),
            (
                "leanest: bf16-pure + accum x8 + block + chunked + adamw8bit",
                {
                    "train.precision": "bf16-pure",
                    "train.micro_batch_size": "4",
                    "memory.checkpointing": "block",
                    "memory.loss_chunk": "1024",
                    "optim.name": "adamw8bit",
                },
            ),
        ],
    },
    "larger": {  # GPT-2 small (124M) at seq 512, batch 8: still trains on this CPU
        "preset": "gpt2",
        "base": {
            "train.precision": "fp32",
            "data.seq_len": "512",
            "train.batch_size": "8",
            "train.micro_batch_size": "8",
            "model.dropout": "0.1",
        },
        "rows": [
            ("none", {}),
            ("bf16 autocast", {"train.precision": "bf16"}),
            (
                "best fast: bf16 + selective + chunked loss",
                {
                    "train.precision": "bf16",
                    "memory.checkpointing": "selective",
                    "memory.loss_chunk": "1024",
                },
            ),
            (
                "best exact: bf16 + accum x4 + block + chunked loss",
                {
                    "train.precision": "bf16",
                    "train.micro_batch_size": "2",
                    "memory.checkpointing": "block",
                    "memory.loss_chunk": "1024",
                },
            ),
            (
                "leanest: bf16-pure + accum x8 + block + chunked + adamw8bit",
                {
                    "train.precision": "bf16-pure",
                    "train.micro_batch_size": "1",
                    "memory.checkpointing": "block",
                    "memory.loss_chunk": "512",
                    "optim.name": "adamw8bit",
                },
            ),
        ],
    },
}


def run_one(preset: str, overrides: dict[str, str], steps: int, workdir: Path) -> dict:
    """One configuration in a fresh `onegpu train` process (onegpu bench's row runner)."""
    r = run_row(preset, None, overrides, steps, workdir)
    return {
        "overrides": overrides,
        "peak_step_bytes": r["peak_mem_bytes"],
        "breakdown": r["memory"],
        "saved_activation_bytes": r["saved_activations_per_micro_batch"],
        "peak_rss_bytes": r["peak_rss_bytes"],
        "step_time_s": r["step_time_s"],
        "tokens_per_s": r["tokens_per_s"],
        "loss": r["loss"],
        "wall_s": r["wall_s"],
    }


def markdown(name: str, grid: dict, results: list[dict], command: str) -> str:
    none = results[0]
    lines = [
        f"# Memory techniques on `{grid['preset']}` ({name} grid)",
        "",
        f"Command: `{command}`  ",
        f"Machine: {platform.processor() or platform.machine()}, {torch.get_num_threads()} threads, "
        f"torch {torch.__version__}, {time.strftime('%Y-%m-%d')}.  ",
        "Base of every row: "
        + ", ".join(f"`{k}={v}`" for k, v in grid["base"].items())
        + "; each row adds its overrides.",
        "",
        "| configuration | step peak | x vs none | params | grads | optimizer | activations "
        "| other | saved/micro-batch | peak RSS | step time | x vs none | tokens/s | loss |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    mib = 2**20
    for r in results:
        b = r["breakdown"]
        lines.append(
            f"| {r['name']} | {r['peak_step_bytes'] / mib:,.0f} MiB "
            f"| {none['peak_step_bytes'] / r['peak_step_bytes']:.2f}x less "
            + "".join(f"| {b[k] / mib:,.0f} " for k in ("params", "grads", "optimizer"))
            + f"| {b['activations'] / mib:,.0f} | {b['other'] / mib:,.0f} "
            f"| {r['saved_activation_bytes'] / mib:,.0f} MiB | {r['peak_rss_bytes'] / mib:,.0f} MiB "
            f"| {r['step_time_s']:.2f} s | {r['step_time_s'] / none['step_time_s']:.2f}x "
            f"| {r['tokens_per_s']:,.0f} | {r['loss']:.3f} |"
        )
    lines += [
        "",
        "Memory columns are MiB of tensors at the step's peak (profiler memory timeline); "
        "`x vs none` for memory is none's peak / this row's peak (higher is better), for time "
        "this row's step time / none's (lower is better).",
    ]
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--grid", choices=sorted(GRIDS), default="seed-ref")
    ap.add_argument("--steps", type=int, default=6, help="median over the steps after the 3rd")
    ap.add_argument("--only", default="", help="comma-separated row names (default: all)")
    ap.add_argument("--out-dir", default="benchmarks/results")
    args = ap.parse_args()
    grid = GRIDS[args.grid]
    rows = grid["rows"]
    if args.only:
        wanted = set(args.only.split(","))
        rows = [r for r in rows if r[0] in wanted]
    command = shlex.join([Path(sys.executable).name, *sys.argv])
    results = []
    with tempfile.TemporaryDirectory() as workdir:
        for name, overrides in rows:
            r = run_one(grid["preset"], {**grid["base"], **overrides}, args.steps, Path(workdir))
            r["name"] = name
            results.append(r)
            print(
                f"{name}: peak {r['peak_step_bytes'] / 2**20:,.0f} MiB, "
                f"{r['step_time_s']:.2f} s/step, loss {r['loss']:.3f} ({r['wall_s']:.0f} s)",
                flush=True,
            )
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    stem = f"memory-{args.grid}"
    previous = out / f"{stem}.json"
    if args.only and previous.exists():  # re-measured rows replace their old selves
        fresh = {r["name"]: r for r in results}
        old = json.loads(previous.read_text())["rows"]
        results = [fresh.pop(r["name"], r) for r in old] + list(fresh.values())
        command = json.loads(previous.read_text())["command"] + f"; re-measured: {command}"
    (out / f"{stem}.json").write_text(
        json.dumps({"command": command, "grid": grid, "rows": results}, indent=1) + "\n"
    )
    (out / f"{stem}.md").write_text(markdown(args.grid, grid, results, command))
    print(f"wrote {out / stem}.md and .json")


if __name__ == "__main__":
    main()
