"""Each way of cutting a step's non-matmul work, alone, against the step's matmul floor.

    python benchmarks/step_cuts.py --model B [--rounds 2] [--steps 30] [--only base,regional]

Every row is a fresh `onegpu train` of the model (benchmarks/vs_peers.py's A or B) with one
setting changed from the baseline (eager, the CPU flash attention kernel, the `auto` loss chunk,
the allocator onegpu preloads), rounds interleaved; tokens/s and the step's multiple of its
matmul floor come from the run's summary.json (`step_over_floor`, perf/floor.py), so each cut is
judged by the same number. Writes results/step-cuts-<model>-<date>.{md,json} (never over an
earlier file).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from onegpu.perf.devices import cpu_identity

sys.path.insert(0, str(Path(__file__).parent))
from vs_peers import MODELS, RESULTS, _new_stem  # noqa: E402

BASE = ["--train.compile", "none", "--model.attention", "sdpa", "--train.loss_kernel", "eager",
        "--train.gelu_kernel", "eager"]  # fmt: skip
CUTS: dict[str, tuple[list[str], str]] = {
    "base": (
        [],
        "eager, CPU flash attention (sdpa), auto loss chunk (ATen's kernels), ATen's GELU, "
        "onegpu's allocator",
    ),
    "compile-default": (["--train.compile", "default"], "the whole forward + loss compiled"),
    "compile-regional": (["--train.compile", "regional"], "each block compiled, reused"),
    "compile-max-autotune": (
        ["--train.compile", "max-autotune"],
        "whole graph, inductor's GEMM templates autotuned against oneDNN",
    ),
    "attention-plain": (["--model.attention", "plain"], "matmul attention, fp32 softmax"),
    "attention-blocked": (
        ["--model.attention", "blocked"],
        "matmul attention over causal query blocks, fp32 softmax, probabilities saved",
    ),
    "blocked+compile": (
        ["--model.attention", "blocked", "--train.compile", "default"],
        "blocked attention, the whole forward + loss compiled",
    ),
    "blocked+regional": (
        ["--model.attention", "blocked", "--train.compile", "regional"],
        "blocked attention, each block compiled, reused",
    ),
    "loss-unchunked": (["--memory.loss_chunk", "0"], "the plain loss (full logits)"),
    "loss-compiled": (
        ["--train.loss_kernel", "compiled"],
        "the chunked loss's per-chunk softmax and weight-gradient sum as inductor kernels",
    ),
    "blocked+loss-compiled": (
        ["--model.attention", "blocked", "--train.loss_kernel", "compiled"],
        "blocked attention, the chunked loss's kernels compiled",
    ),
    "blocked+regional+loss-compiled": (
        [
            "--model.attention",
            "blocked",
            "--train.compile",
            "regional",
            "--train.loss_kernel",
            "compiled",
        ],
        "blocked attention, each block compiled, the chunked loss's kernels compiled",
    ),
    "gelu-compiled": (
        ["--train.gelu_kernel", "compiled"],
        "the eager GELU as two inductor kernels (sigmoid form)",
    ),
    "blocked+gelu+loss-compiled": (
        [
            "--model.attention",
            "blocked",
            "--train.gelu_kernel",
            "compiled",
            "--train.loss_kernel",
            "compiled",
        ],
        "blocked attention, GELU and the chunked loss's kernels compiled, the rest eager",
    ),
    "glibc": ([], "ONEGPU_ALLOCATOR=system: glibc malloc, tuned in-process"),
}


def run(model: str, cut: str, steps: int) -> dict:
    extra, _ = CUTS[cut]
    env = {**os.environ, "ONEGPU_ALLOCATOR": "system" if cut == "glibc" else "mimalloc"}
    with tempfile.TemporaryDirectory() as out:
        cmd = [sys.executable, "-m", "onegpu", "train", *MODELS[model]["args"], *BASE, *extra,
               "--out.dir", out, "--train.max_steps", str(steps), "--train.log_every", "5",
               "--train.eval_every", "0", "--out.progress", "false",
               "--out.save_checkpoint", "false"]  # fmt: skip
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
        if proc.returncode != 0:
            sys.exit(f"{cut} failed:\n{proc.stderr[-3000:]}")
        s = json.loads((Path(out) / "summary.json").read_text())
    keys = ("tokens_per_s", "step_time_s", "floor_s", "step_over_floor", "mfu", "peak_mem_bytes")
    return {k: s[k] for k in keys} | {"loss": s["loss"], "allocator": s.get("allocator")}


def table(model: str, med: dict[str, dict], a: argparse.Namespace) -> str:
    base = med.get("base")
    lines = [
        f"# Cuts of the step's non-matmul work, each alone: model {model}",
        "",
        f"`python benchmarks/step_cuts.py --model {a.model} --rounds {a.rounds} --steps {a.steps}`; "
        f"{os.cpu_count()} cores ({cpu_identity()}), torch {torch.__version__}; "
        f"{time.strftime('%Y-%m-%d')}; medians of {a.rounds} interleaved rounds (fresh process "
        "each, steady steps from summary.json). Baseline flags: " + " ".join(BASE) + ".",
        "",
        "| cut | what | tokens/s | x base | step | floor | x floor | x base floor | MFU "
        "| peak RSS | loss |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]

    def base_floor(m: dict) -> float:
        return m["step_time_s"] / (base or m)["floor_s"]

    for name, m in med.items():
        ratio = f"{m['tokens_per_s'] / base['tokens_per_s']:.2f}" if base else "-"
        lines.append(
            f"| {name} | {CUTS[name][1]} | {m['tokens_per_s']:,.0f} | {ratio} "
            f"| {m['step_time_s'] * 1e3:,.0f} ms | {m['floor_s'] * 1e3:,.0f} ms "
            f"| {m['step_over_floor']:.2f}x | {base_floor(m):.2f}x | {m['mfu']:.0%} "
            f"| {m['peak_mem_bytes'] / 2**20:,.0f} MiB | {m['loss']:.4f} |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", default="B", choices=sorted(MODELS))
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--only", default=",".join(CUTS), help=f"of {','.join(CUTS)}")
    a = ap.parse_args()
    names = a.only.split(",")
    unknown = [n for n in names if n not in CUTS]
    if unknown:
        sys.exit(f"--only: unknown cut(s) {unknown}; choose from {', '.join(CUTS)}")
    for n in names:  # fills the caches (tokenizer, timings, inductor's compiled code), uncounted
        run(a.model, n, 3)
    runs: dict[str, list[dict]] = {n: [] for n in names}
    for r in range(a.rounds):
        for n in names:
            runs[n].append(run(a.model, n, a.steps))
            m = runs[n][-1]
            print(f"round {r + 1} {n}: {m['tokens_per_s']:,.0f} tokens/s, "
                  f"{m['step_over_floor']:.2f}x the floor", flush=True)  # fmt: skip
    med = {
        n: {k: statistics.median(x[k] for x in rs) for k in rs[0] if k != "allocator"}
        for n, rs in runs.items()
    }
    text = table(a.model, med, a)
    stem = _new_stem(f"step-cuts-{a.model}-{time.strftime('%Y-%m-%d')}")
    (RESULTS / f"{stem}.md").write_text(text)
    (RESULTS / f"{stem}.json").write_text(json.dumps({"runs": runs, "median": med}, indent=1))
    print(text)


if __name__ == "__main__":
    main()
