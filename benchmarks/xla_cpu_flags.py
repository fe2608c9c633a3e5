"""XLA's CPU options on the JAX backend's step, by precision, beside the torch backend.

    python benchmarks/xla_cpu_flags.py --model B [--rounds 2] [--steps 12] [--only none-fp32,...]
    python benchmarks/xla_cpu_flags.py --dot      # one 2048^3 product per flag and dtype

Every row is a fresh `onegpu train --train.backend jax` of the model (benchmarks/vs_peers.py's A
or B) with `train.xla_flags` and `train.precision` fixed (XLA reads its flags once per process,
so each setting needs a process of its own), rounds interleaved; `auto` rows leave both to the
backend's own trial, and `torch` is the torch backend's defaults at the same run length. This is
what `train.xla_flags auto` and `train.precision auto` decide per machine kind: the file says
which settings win on the CPU at hand. Writes results/xla-cpu-flags-<model>-<date>.{md,json}
(never over an earlier file).

--dot: the product alone, jitted, in fp32 and bf16 under each XLA setting (a process each, with
ONEDNN_VERBOSE=1 to count the oneDNN primitives XLA creates), beside torch's on the same cores:
whether XLA reaches the CPU's bf16 units at all. Writes results/xla-cpu-dot-<date>.md.
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

import jax

from onegpu.config.backends import XLA_CPU_SETTINGS
from onegpu.perf.devices import cpu_identity

sys.path.insert(0, str(Path(__file__).parent))
from records import bf16_kind  # noqa: E402
from vs_peers import MODELS, RESULTS, _new_stem  # noqa: E402

ROWS: dict[str, list[str]] = {
    f"{flags}-{precision}": [
        "--train.backend", "jax", "--train.xla_flags", flags, "--train.precision", precision,
    ]
    for precision in ("fp32", "bf16")
    for flags in XLA_CPU_SETTINGS
}  # fmt: skip
ROWS["jax-auto"] = ["--train.backend", "jax"]
"""JAX with `train.precision auto` and `train.xla_flags auto` (a short run takes a cached
choice or XLA's defaults: see docs/jax.md)."""
ROWS["torch"] = ["--train.backend", "torch"]
"""The torch backend's defaults at the same run length, for the ratio issue 30 quotes."""


def run(model: str, row: str, steps: int) -> dict:
    """One fresh `onegpu train` of `row`; its summary.json's steady-step figures."""
    with tempfile.TemporaryDirectory() as out:
        cmd = [sys.executable, "-m", "onegpu", "train", *MODELS[model]["args"], *ROWS[row],
               "--out.dir", out, "--train.max_steps", str(steps), "--train.log_every", "4",
               "--train.eval_every", "0", "--out.progress", "false",
               "--out.save_checkpoint", "false"]  # fmt: skip
        env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
        if proc.returncode != 0:
            sys.exit(f"{row} failed:\n{proc.stderr[-3000:]}")
        s = json.loads((Path(out) / "summary.json").read_text())
    chosen = s["config"]["train"]
    return {
        "tokens_per_s": s["tokens_per_s"],
        "step_time_s": s["step_time_s"],
        "mfu": s.get("mfu") or 0.0,
        "loss": s["loss"],
        "precision": s["precision"],
        "xla_flags": chosen.get("xla_flags", "-"),
    }


DOT_N = 2048
DOT_PROBE = """
import json, sys, time
import jax, jax.numpy as jnp
n = int(sys.argv[1])
out = {}
for name in ("float32", "bfloat16"):
    a = jnp.ones((n, n), name)
    f = jax.jit(lambda a, b: a @ b)
    f(a, a).block_until_ready()
    runs = []
    for _ in range(15):
        t0 = time.perf_counter()
        f(a, a).block_until_ready()
        runs.append(time.perf_counter() - t0)
    out[name] = runs
print(json.dumps(out))
"""
"""One jitted product per dtype, 15 timed runs after a first: run with XLA_FLAGS set."""


def _rates(runs: list[float]) -> str:
    """'best / median' GFLOP/s of DOT_N^3 products timed `runs`."""
    flop = 2 * DOT_N**3
    return f"{flop / min(runs) / 1e9:,.0f} / {flop / statistics.median(runs) / 1e9:,.0f}"


TORCH_PROBE = """
import json, sys, time
import torch
n = int(sys.argv[1])
out = {}
for name in ("float32", "bfloat16"):
    a = torch.ones(n, n, dtype=getattr(torch, name))
    a @ a
    runs = []
    for _ in range(15):
        t0 = time.perf_counter()
        a @ a
        runs.append(time.perf_counter() - t0)
    out[name] = runs
print(json.dumps(out))
"""
"""The same product in torch: the rate to compare with, and the control that oneDNN's verbose
log is seen at all (torch's bf16 product runs in oneDNN)."""
DOT_SETTINGS = {
    "none": "",
    **XLA_CPU_SETTINGS,
    "onednn-fusion-dot": "--xla_cpu_experimental_onednn_fusion_type=dot",
    "onednn-custom-call": "--xla_cpu_experimental_onednn_custom_call=true --xla_cpu_use_onednn=true",
}
"""XLA_FLAGS the product is timed under: train.xla_flags' settings, and the two oneDNN paths
this jaxlib accepts (the custom call is what openxla/xla#10556 described for AMX)."""


def _probe(what: str, probe: str, flags: str) -> str:
    """A table row: GFLOP/s of `probe` (best / median per dtype) in a process of its own with
    XLA_FLAGS=`flags`, and the oneDNN calls its verbose log printed."""
    env = {**os.environ, "XLA_FLAGS": flags, "ONEDNN_VERBOSE": "1"}
    proc = subprocess.run(
        [sys.executable, "-c", probe, str(DOT_N)], env=env, capture_output=True, text=True
    )
    if proc.returncode != 0:
        return f"| {what} | `{flags or '-'}` | failed | failed | - |"
    lines = proc.stdout.strip().splitlines()
    runs = json.loads(lines[-1])
    onednn = sum(1 for x in lines if x.startswith("onednn_verbose") and ",exec," in x)
    return (
        f"| {what} | `{flags or '-'}` | {_rates(runs['float32'])} | {_rates(runs['bfloat16'])} "
        f"| {onednn} |"
    )


def dot_rates() -> list[str]:
    """Table rows: one jitted product per XLA setting and dtype (a process each, oneDNN's
    verbose log on to count its calls), then torch's."""
    import torch

    rows = [_probe(f"jax, {name}", DOT_PROBE, flags) for name, flags in DOT_SETTINGS.items()]
    return rows + [_probe(f"torch {torch.__version__}", TORCH_PROBE, "")]


def dot_table() -> str:
    return "\n".join([
        f"# One {DOT_N}^3 product: XLA's CPU settings against torch",
        "",
        f"`python benchmarks/xla_cpu_flags.py --dot`; {os.cpu_count()} cores ({cpu_identity()}; "
        f"bf16: {bf16_kind()}), jax {jax.__version__}; {time.strftime('%Y-%m-%d')}; GFLOP/s, "
        "best / median of 15 runs after a first; oneDNN calls: the `exec` lines ONEDNN_VERBOSE=1 "
        "printed in the process (0: it never called oneDNN; torch's row is the control that "
        "the log is seen).",
        "",
        "| what | XLA_FLAGS | fp32 GFLOP/s | bf16 GFLOP/s | oneDNN calls |",
        "|---|---|---|---|---|",
        *dot_rates(),
    ]) + "\n"  # fmt: skip


def table(model: str, med: dict[str, dict], picks: dict[str, dict], a: argparse.Namespace) -> str:
    ref = med.get("none-fp32")
    torch_row = med.get("torch")
    lines = [
        f"# XLA's CPU options on model {model}'s JAX step",
        "",
        f"`python benchmarks/xla_cpu_flags.py --model {a.model} --rounds {a.rounds} --steps "
        f"{a.steps}`; {os.cpu_count()} cores ({cpu_identity()}; bf16: {bf16_kind()}), jax "
        f"{jax.__version__}; {time.strftime('%Y-%m-%d')}; medians of {a.rounds} interleaved "
        "rounds (fresh process each, steady steps from summary.json, XLA_FLAGS unset).",
        "",
        "| row | XLA flags | precision | tokens/s | x none-fp32 | x torch | step | MFU | loss |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for name, m in med.items():
        vs_ref = f"{m['tokens_per_s'] / ref['tokens_per_s']:.2f}" if ref else "-"
        vs_torch = f"{m['tokens_per_s'] / torch_row['tokens_per_s']:.2f}" if torch_row else "-"
        lines.append(
            f"| {name} | {picks[name]['xla_flags']} | {picks[name]['precision']} "
            f"| {m['tokens_per_s']:,.0f} | {vs_ref} | {vs_torch} | {m['step_time_s'] * 1e3:,.0f} ms "
            f"| {m['mfu']:.0%} | {m['loss']:.6f} |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", default="B", choices=sorted(MODELS))
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--only", default=",".join(ROWS), help=f"of {','.join(ROWS)}")
    ap.add_argument("--dot", action="store_true", help="one product per setting, not the step")
    a = ap.parse_args()
    if a.dot:
        text = dot_table()
        stem = _new_stem(f"xla-cpu-dot-{time.strftime('%Y-%m-%d')}")
        (RESULTS / f"{stem}.md").write_text(text)
        print(text)
        return
    names = a.only.split(",")
    unknown = [n for n in names if n not in ROWS]
    if unknown:
        sys.exit(f"--only: unknown row(s) {unknown}; choose from {', '.join(ROWS)}")
    for n in names:  # fills the caches (tokenizer, precision and loss-chunk timings), uncounted
        run(a.model, n, 2)
    runs: dict[str, list[dict]] = {n: [] for n in names}
    for r in range(a.rounds):
        for n in names:
            runs[n].append(run(a.model, n, a.steps))
            print(f"round {r + 1} {n}: {runs[n][-1]['tokens_per_s']:,.0f} tokens/s", flush=True)
    numeric = ("tokens_per_s", "step_time_s", "mfu", "loss")
    med = {n: {k: statistics.median(x[k] for x in rs) for k in numeric} for n, rs in runs.items()}
    picks = {n: rs[-1] for n, rs in runs.items()}
    text = table(a.model, med, picks, a)
    stem = _new_stem(f"xla-cpu-flags-{a.model}-{time.strftime('%Y-%m-%d')}")
    (RESULTS / f"{stem}.md").write_text(text)
    (RESULTS / f"{stem}.json").write_text(json.dumps({"runs": runs, "median": med}, indent=1))
    print(text)


if __name__ == "__main__":
    main()
