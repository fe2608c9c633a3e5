"""The host allocator's share of a CPU training step: glibc as shipped, glibc tuned in-process
(onegpu's in-process fallback), mimalloc from the `cmeel-mimalloc` wheel (what `pip install`
gives onegpu on Linux), tcmalloc (when the system has it).

    python benchmarks/allocators.py [--model B|A] [--steps 13] [--rounds 3]

Model B: 6 layers, d_model 384, 6 heads, seq 256, BPE vocabulary 8,192, micro-batch 16.
Model A: the `seed-ref` preset (GPT-2 vocabulary, seq 512), batch 8. Each row is a fresh
`onegpu train` process with onegpu's device defaults; rows are interleaved per round. Reported:
median tokens/s over the steps after 3 warm-up steps (median over rounds), the process's peak
RSS, and its minor page faults (getrusage of the child: each one a page the kernel zero-filled).
Writes benchmarks/results/allocators-<model>.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from onegpu.perf.allocator import find_mimalloc, find_tcmalloc

RESULTS = Path(__file__).parent / "results"
WARM = 3
MODELS = {
    "B": ["--model.n_layer", "6", "--model.d_model", "384", "--model.n_head", "6",
          "--model.seq_len", "256", "--model.vocab_size", "8192", "--model.dropout", "0",
          "--train.batch_size", "16", "--train.micro_batch_size", "16"],
    "A": ["--preset", "seed-ref", "--model.dropout", "0", "--train.batch_size", "8",
          "--train.micro_batch_size", "8"],
}  # fmt: skip


def rows() -> dict[str, dict[str, str]]:
    out = {"glibc (system)": {"ONEGPU_ALLOCATOR": "system"},
           "glibc tuned in-process (mallopt)": {"ONEGPU_ALLOCATOR": "glibc-tuned"}}  # fmt: skip
    if find_mimalloc():
        out["mimalloc (cmeel-mimalloc wheel)"] = {"ONEGPU_ALLOCATOR": "mimalloc"}
    if find_tcmalloc():
        out["tcmalloc (system package)"] = {"ONEGPU_ALLOCATOR": "tcmalloc"}
    return out


def run(model: str, steps: int, env: dict[str, str]) -> dict:
    with tempfile.TemporaryDirectory() as out:
        cmd = [sys.executable, "-m", "onegpu", "train", *MODELS[model], "--out.dir", out,
               "--train.max_steps", str(steps), "--train.log_every", "1", "--train.eval_every", "0",
               "--train.measure_memory", "false", "--out.progress", "false",
               "--out.save_checkpoint", "false"]  # fmt: skip
        before = resource.getrusage(resource.RUSAGE_CHILDREN).ru_minflt
        subprocess.run(cmd, check=True, capture_output=True, env={**os.environ, **env})
        faults = resource.getrusage(resource.RUSAGE_CHILDREN).ru_minflt - before
        metrics = [json.loads(x) for x in (Path(out) / "metrics.jsonl").read_text().splitlines()]
        summary = json.loads((Path(out) / "summary.json").read_text())
    times = [m["step_time_s"] for m in metrics if m["step"] > WARM]
    tokens = summary["tokens"] / summary["steps"]
    return {"tokens_per_s": tokens / statistics.median(times), "peak_rss": summary["peak_mem_bytes"],
            "minor_faults": faults, "allocator": summary["allocator"],
            "precision": summary["precision"]}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="B", choices=sorted(MODELS))
    ap.add_argument("--steps", type=int, default=13)
    ap.add_argument("--rounds", type=int, default=3)
    a = ap.parse_args()
    got: dict[str, list[dict]] = {name: [] for name in rows()}
    for r in range(a.rounds):
        for name, env in rows().items():
            got[name].append(run(a.model, a.steps, env))
            print(
                f"round {r + 1} {name}: {got[name][-1]['tokens_per_s']:,.0f} tokens/s", flush=True
            )
    med = {n: {k: statistics.median(x[k] for x in rs) for k in ("tokens_per_s", "peak_rss", "minor_faults")}
           | {"allocator": rs[0]["allocator"], "precision": rs[0]["precision"]} for n, rs in got.items()}  # fmt: skip
    ref = med.get("tcmalloc (system package)", med["glibc (system)"])["tokens_per_s"]
    cmd = f"python benchmarks/allocators.py --model {a.model} --steps {a.steps} --rounds {a.rounds}"
    machine = f"{platform.machine()}, {os.cpu_count()} cores, {platform.platform()}"
    lines = [f"# Host allocators, model {a.model} ({next(iter(med.values()))['precision']})", "",
             f"`{cmd}`; {machine}; medians of {a.rounds} interleaved rounds, "
             f"{a.steps - WARM} steady steps each.", "",
             "| allocator | summary.json says | tokens/s | x tcmalloc | peak RSS | minor page faults |",
             "|---|---|---|---|---|---|"]  # fmt: skip
    for n, m in med.items():
        lines.append(f"| {n} | {m['allocator']} | {m['tokens_per_s']:,.0f} | {m['tokens_per_s'] / ref:.2f} "
                     f"| {m['peak_rss'] / 2**20:,.0f} MiB | {m['minor_faults']:,.0f} |")  # fmt: skip
    RESULTS.mkdir(exist_ok=True)
    stem = f"allocators-{a.model}"
    (RESULTS / f"{stem}.json").write_text(json.dumps({"command": cmd, "machine": machine, "runs": got, "median": med}, indent=1) + "\n")  # fmt: skip
    (RESULTS / f"{stem}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
