"""Each way of cutting a step's non-matmul work, alone, against the step's matmul floor.

    python benchmarks/step_cuts.py --model B [--rounds 2] [--steps 30] [--only base,regional]
    python benchmarks/step_cuts.py --model B --paired [--cycles 12] [--turn-steps 3] [--only ...]
    python benchmarks/step_cuts.py --costs results/step-cuts-B-paired-<date>.json
    git worktree add /tmp/before HEAD~1 && \\
        python benchmarks/step_cuts.py --model B --paired --only base,X --before /tmp/before

Every row is a fresh `onegpu train` of the model (benchmarks/vs_peers.py's A or B) with one
setting changed from the baseline (eager, the CPU flash attention kernel, the `auto` loss chunk,
the allocator onegpu preloads), rounds interleaved; tokens/s and the step's multiple of its
matmul floor come from the run's summary.json (`step_over_floor`, perf/floor.py), so each cut is
judged by the same number. With --paired every cut's process is alive at once and they are
timed in turns (benchmarks/paired.py: for a machine whose speed drifts within seconds), and
`x base` is the median over cycles of each cycle's ratio; each distinct floor runs in the
turns too (benchmarks/floor_turns.py), for `x floor in turns`. With --before TREE every cut also runs
from that source tree (an earlier commit: PYTHONPATH=TREE/src), named `<cut>@before`, and
`x before` is each cut's ratio to its own run from TREE: what a change did to it. The `free-*`
cuts are ablations (benchmarks/what_if/sitecustomize.py): `auto`'s choice with a part of the
step made free, so the step less theirs is what that part costs in the step (printed under the
table, or by --costs from a record); `fast-exp` and `ftz` the same with other arithmetic
(inductor's exponentials as ATen's faster ones; denormals flushed to zero). Writes
results/step-cuts-<model>[-paired]-<date>.{md,json} (never over an earlier file).
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
import floor_turns  # noqa: E402
import paired  # noqa: E402
from paired import Contestant, ratio, run_in_turns, spread, step_time  # noqa: E402
from vs_peers import (  # noqa: E402
    MODELS,
    ONEGPU_STEPS,
    RESULTS,
    WARM,
    _in_turns,
    _new_stem,
    check_paired_steps,
    floor_contestant,
    model_floor,
)

BASE = ["--train.compile", "none", "--model.attention", "sdpa", "--train.loss_kernel", "eager",
        "--train.gelu_kernel", "eager"]  # fmt: skip
AUTO_FLAGS = ["--model.attention", "blocked", "--train.compile", "regional",
              "--train.loss_kernel", "compiled"]  # fmt: skip
"""`auto`'s choice for A and B on a CPU with bf16 matmuls: what the what-if cuts start from."""
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
    "blocked+max-autotune": (
        ["--model.attention", "blocked", "--train.compile", "max-autotune"],
        "blocked attention, whole graph, inductor's GEMM templates (AMX micro-GEMM, epilogues)",
    ),
    "blocked+compile+cpp-wrapper": (
        ["--model.attention", "blocked", "--train.compile", "default"],
        "blocked attention, whole graph, TORCHINDUCTOR_CPP_WRAPPER=1 (the wrapper in C++)",
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
        AUTO_FLAGS,
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
    "blocked+regional+loss-compiled+thp": (
        AUTO_FLAGS,
        "as blocked+regional+loss-compiled, torch's large host buffers on transparent huge "
        "pages (THP_MEM_ALLOC_ENABLE=1)",
    ),
    "fast-exp": (
        AUTO_FLAGS,
        "what if: blocked+regional+loss-compiled with inductor's exponentials as ATen's exp_u20",
    ),
    "ftz": (
        AUTO_FLAGS,
        "what if: blocked+regional+loss-compiled with denormals flushed to zero (FTZ/DAZ)",
    ),
    "free-gelu": (AUTO_FLAGS, "what if: blocked+regional+loss-compiled with the GELU free"),
    "free-gelu+layernorm": (
        AUTO_FLAGS,
        "what if: blocked+regional+loss-compiled with the GELU and the LayerNorms free",
    ),
    "free-gelu+layernorm+optimizer": (
        AUTO_FLAGS,
        "what if: blocked+regional+loss-compiled with the GELU, the LayerNorms, the clipping "
        "and the optimizer step free",
    ),
    "free-gelu+layernorm+optimizer+attention-softmax": (
        AUTO_FLAGS,
        "what if: as free-gelu+layernorm+optimizer, and blocked attention's forward softmax a "
        "cast (of its scores times scale / keys)",
    ),
    "free-gelu+layernorm+optimizer+attention-softmax+loss-softmax": (
        AUTO_FLAGS,
        "what if: as free-gelu+layernorm+optimizer+attention-softmax, and the loss's softmax "
        "gradient zeros",
    ),
}
CUT_ENV: dict[str, dict[str, str]] = {
    "glibc": {"ONEGPU_ALLOCATOR": "system"},
    "blocked+compile+cpp-wrapper": {"TORCHINDUCTOR_CPP_WRAPPER": "1"},
    "blocked+regional+loss-compiled+thp": {"THP_MEM_ALLOC_ENABLE": "1"},
    "ftz": {"ONEGPU_WHAT_IF": "ftz"},
    "fast-exp": {
        "ONEGPU_WHAT_IF": "exp_u20",
        "TORCHINDUCTOR_FX_GRAPH_CACHE": "0",  # kernels generated anew, not read from the cache
        "TORCHINDUCTOR_AUTOGRAD_CACHE": "0",
    },
    **{
        cut: {"ONEGPU_WHAT_IF": cut.removeprefix("free-").replace("+", ",")}
        for cut in CUTS
        if cut.startswith("free-")
    },
}
"""What a cut sets in the environment (every other cut: onegpu's default allocator)."""


BEFORE = "@before"
"""The suffix of a cut run from the --before tree."""
BEFORE_TREE: list[Path] = []
"""The --before tree, once given."""


def cut_of(name: str) -> str:
    """The cut a contestant runs (its name without the @before suffix)."""
    return name.removesuffix(BEFORE)


def command(model: str, cut: str, out: str | Path, steps: int, log_every: int) -> list[str]:
    flags = CUTS[cut_of(cut)][0]
    return [sys.executable, "-m", "onegpu", "train", *MODELS[model]["args"], *BASE, *flags,
            "--out.dir", str(out), "--train.max_steps", str(steps),
            "--train.log_every", str(log_every), "--train.eval_every", "0",
            "--out.progress", "false", "--out.save_checkpoint", "false"]  # fmt: skip


WHAT_IF = Path(__file__).parent / "what_if"
"""The folder whose sitecustomize.py makes a part of the step free (`ONEGPU_WHAT_IF`)."""


def environment(cut: str) -> dict[str, str]:
    """The cut's process environment: this one's, onegpu's allocator, what the cut sets; the
    --before tree's sources and the what-if folder ahead of any PYTHONPATH given. A what-if
    comes from its cut only: an ONEGPU_WHAT_IF left in the shell would ablate every cut."""
    inherited = {k: v for k, v in os.environ.items() if k != "ONEGPU_WHAT_IF"}
    own = CUT_ENV.get(cut_of(cut), {})
    env = {**inherited, "ONEGPU_ALLOCATOR": "mimalloc", **own}
    paths = [str(BEFORE_TREE[0] / "src")] if cut.endswith(BEFORE) else []
    if "ONEGPU_WHAT_IF" in own:
        paths.append(str(WHAT_IF))
    if paths:
        env["PYTHONPATH"] = os.pathsep.join([*paths, *filter(None, [env.get("PYTHONPATH")])])
    return env


KEYS = ("tokens_per_s", "step_time_s", "floor_s", "step_over_floor", "mfu", "peak_mem_bytes")


def run(model: str, cut: str, steps: int) -> dict:
    with tempfile.TemporaryDirectory() as out:
        cmd = command(model, cut, out, steps, log_every=5)
        proc = subprocess.run(cmd, env=environment(cut), capture_output=True, text=True)
        if proc.returncode != 0:
            sys.exit(f"{cut} failed:\n{proc.stderr[-3000:]}")
        s = json.loads((Path(out) / "summary.json").read_text())
    return {k: s[k] for k in KEYS} | {"loss": s["loss"], "allocator": s.get("allocator")}


def run_paired(model: str, names: list[str], cycles: int, turn_steps: int) -> dict[str, dict]:
    """Every cut alive at once, timed in turns; each one's figures at its paired step time, and
    `x_base`: how many times faster it ran than `base`, cycle by cycle."""
    check_paired_steps(cycles, turn_steps)
    # each cut's cached floor, timed (where missing) before any contestant runs beside it: a
    # product timed while other processes end reads their moment (a floor of B 7.9x too slow)
    cached_floors = {n: model_floor(model, [*BASE, *CUTS[cut_of(n)][0]])["floor_s"] for n in names}
    with tempfile.TemporaryDirectory() as tmp:
        contestants = []
        for n in names:
            folder = Path(tmp) / n
            folder.mkdir()
            cmd = command(model, n, folder, ONEGPU_STEPS, log_every=1)
            contestants.append(Contestant(n, cmd, environment(n), folder / "metrics.jsonl"))
        floors = floors_in_turns(model, names, Path(tmp))
        last_user = {id(floors[c.name]): i for i, c in enumerate(contestants)}
        turns = []
        for i, c in enumerate(contestants):  # each floor right after the last cut it serves
            turns.append(c)
            if last_user[id(floors[c.name])] == i:
                turns.append(floors[c.name])
        run_in_turns(turns, WARM, cycles, turn_steps, log=lambda m: print(m, flush=True))
        found = {}
        for c in contestants:
            s = json.loads((c.steps_file.parent / "summary.json").read_text())
            step = step_time(c)
            floor_s = cached_floors[c.name]  # a stopped run measures no floor of its own
            scale = s["step_time_s"] / step  # its own steady steps against its paired ones
            found[c.name] = {
                "tokens_per_s": s["tokens_per_s"] * scale, "step_time_s": step,
                "floor_s": floor_s, "step_over_floor": step / floor_s,
                "mfu": (s["mfu"] or 0.0) * scale, "peak_mem_bytes": c.peak_rss_bytes, "loss": s["loss"],
                "turns": c.turns, "floor_in_turns": {"x": ratio(floors[c.name], c),
                "spread": spread(floors[c.name], c), "floor_s": step_time(floors[c.name]),
                "turns": floors[c.name].turns},
            }  # fmt: skip
        by_name = {c.name: c for c in contestants}
        base = by_name.get("base")
        for c in contestants:
            found[c.name]["x_base"] = ratio(c, base) if base else None
            found[c.name]["x_base_spread"] = spread(c, base) if base else None
            before = by_name.get(c.name + BEFORE)
            found[c.name]["x_before"] = ratio(c, before) if before else None
            found[c.name]["x_before_spread"] = spread(c, before) if before else None
    return found


def floors_in_turns(model: str, names: list[str], tmp: Path) -> dict[str, Contestant]:
    """Each cut's floor as a contestant in turns (benchmarks/floor_turns.py): one per distinct
    set of products (blocked attention and an unchunked loss have their own)."""
    by_products: dict[tuple[str, ...], Contestant] = {}
    found = {}
    for n in names:
        extra = [*BASE, *CUTS[cut_of(n)][0]]
        key = floor_turns.signature(model, extra)
        if key not in by_products:
            name = floor_turns.NAME + (f" {len(by_products) + 1}" if by_products else "")
            by_products[key] = floor_contestant(
                model, extra, tmp / f"floor-{len(by_products)}.jsonl"
            )
            by_products[key].name = name
        found[n] = by_products[key]
    return found


def _counts(a: argparse.Namespace) -> str:
    only = f" --only {a.only}" if a.only != ",".join(CUTS) else ""
    if a.before:
        only += f" --before {a.before}"
    if a.paired:
        return f"{paired.flags(a)}{only}"
    return f"--rounds {a.rounds} --steps {a.steps}{only}"


def _method(a: argparse.Namespace) -> str:
    if a.paired:
        return paired.method(a, "cut")
    return (
        f"medians of {a.rounds} interleaved rounds (fresh process each, steady steps from "
        "summary.json)"
    )


def table(model: str, med: dict[str, dict], a: argparse.Namespace) -> str:
    base = med.get("base")
    lines = [
        f"# Cuts of the step's non-matmul work, each alone: model {model}",
        "",
        f"`python benchmarks/step_cuts.py --model {a.model} {_counts(a)}`; "
        f"{os.cpu_count()} cores ({cpu_identity()}), torch {torch.__version__}; "
        f"{time.strftime('%Y-%m-%d')}; {_method(a)}. Baseline flags: " + " ".join(BASE) + ".",
        "",
        "| cut | what | tokens/s | x base | x before | step | floor | x floor | x base floor "
        "| x floor in turns | MFU | peak RSS | loss |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]

    def base_floor(m: dict) -> float:
        return m["step_time_s"] / (base or m)["floor_s"]

    for name, m in med.items():
        x = m.get("x_base") or (m["tokens_per_s"] / base["tokens_per_s"] if base else None)
        ratio = f"{x:.2f}" if x else "-"
        if m.get("x_base_spread") and name != "base":
            ratio += " ({:.2f}-{:.2f})".format(*m["x_base_spread"])
        before = "-"
        if m.get("x_before"):
            before = "{:.2f} ({:.2f}-{:.2f})".format(m["x_before"], *m["x_before_spread"])
        lines.append(
            f"| {name} | {CUTS[cut_of(name)][1]} | {m['tokens_per_s']:,.0f} | {ratio} | {before} "
            f"| {m['step_time_s'] * 1e3:,.0f} ms | {m['floor_s'] * 1e3:,.0f} ms "
            f"| {m['step_over_floor']:.2f}x | {base_floor(m):.2f}x | {_in_turns(m)} | {m['mfu']:.0%} "
            f"| {m['peak_mem_bytes'] / 2**20:,.0f} MiB | {m['loss']:.4f} |"
        )
    return "\n".join(lines) + "\n"


AUTO_CUT = "blocked+regional+loss-compiled"
"""The cut that runs `auto`'s choice: what every what-if is measured against."""


def ablated_from(cut: str) -> str | None:
    """The cut a what-if cut takes one part away from (free-a+b from free-a; free-a, fast-exp
    and ftz from `auto`'s step), or None for a cut that is not a what-if."""
    if cut in ("fast-exp", "ftz"):
        return AUTO_CUT
    if not cut.startswith("free-"):
        return None
    fewer = cut.rpartition("+")[0]
    return fewer if fewer else AUTO_CUT


def part_costs(runs: dict[str, list[dict]]) -> str:
    """What each what-if's part costs in the step, from a paired run's turns: each cycle's step
    (the median of its turn) of the cut it ablates from less its own, the median over cycles
    and the quartiles (as paired.spread takes them); then each chain of parts together, against
    `auto`'s step. Empty where the run has no such pair."""

    def cycle_steps(cut: str) -> list[float]:
        return [statistics.median(turn) for turn in runs[cut][0]["turns"]]

    rows = []
    pairs = [(cut, ablated_from(cut)) for cut in runs]
    pairs += [(cut, AUTO_CUT) for cut, origin in pairs if origin not in (None, AUTO_CUT)]
    for cut, origin in pairs:  # each part alone, then each chain's parts together
        if origin not in runs or "turns" not in runs[cut][0]:
            continue
        saved_ms = [(a - b) * 1e3 for a, b in zip(cycle_steps(origin), cycle_steps(cut))]
        q1, _, q3 = statistics.quantiles(saved_ms, n=4)
        rows.append(
            f"| {cut} | {origin} | {statistics.median(saved_ms):.1f} ms ({q1:.1f} to {q3:.1f}) |"
        )
    if not rows:
        return ""
    head = ["", "What each what-if's part costs in the step (its origin's step less its own, a "
            "cycle at a time: the median over cycles, quartiles in brackets):", "",
            "| what-if | against | the part's cost a step |", "|---|---|---|"]  # fmt: skip
    return "\n".join(head + rows) + "\n"


def run_rounds(model: str, names: list[str], rounds: int, steps: int) -> dict[str, list[dict]]:
    runs: dict[str, list[dict]] = {n: [] for n in names}
    for r in range(rounds):
        for n in names:
            runs[n].append(run(model, n, steps))
            m = runs[n][-1]
            print(f"round {r + 1} {n}: {m['tokens_per_s']:,.0f} tokens/s, "
                  f"{m['step_over_floor']:.2f}x the floor", flush=True)  # fmt: skip
    return runs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", default="B", choices=sorted(MODELS))
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--only", default=",".join(CUTS), help=f"of {','.join(CUTS)}")
    ap.add_argument(
        "--before", help="a source tree of an earlier commit: each cut runs from it too"
    )
    ap.add_argument(
        "--costs",
        metavar="RESULT.json",
        help="print what each what-if's part costs, from an earlier paired run's record; no run",
    )
    paired.add_arguments(ap)
    a = ap.parse_args()
    if a.costs:
        print(part_costs(json.loads(Path(a.costs).read_text())["runs"]) or "no what-if pairs")
        return
    names = a.only.split(",")
    unknown = [n for n in names if n not in CUTS]
    if unknown:
        sys.exit(f"--only: unknown cut(s) {unknown}; choose from {', '.join(CUTS)}")
    if a.before:
        if not (Path(a.before) / "src" / "onegpu").is_dir():
            sys.exit(f"--before: {a.before} holds no src/onegpu; give a checkout of this repo")
        BEFORE_TREE.append(Path(a.before).resolve())
        names += [n + BEFORE for n in names]
    for n in names:  # fills the caches (tokenizer, timings, inductor's compiled code), uncounted
        run(a.model, n, 3)
    if a.paired:
        med = run_paired(a.model, names, a.cycles, a.turn_steps)
        runs = {n: [m] for n, m in med.items()}
    else:
        runs = run_rounds(a.model, names, a.rounds, a.steps)
        med = {
            n: {k: statistics.median(x[k] for x in rs) for k in rs[0] if k != "allocator"}
            for n, rs in runs.items()
        }
    text = table(a.model, med, a) + part_costs(runs)
    turns = "-paired" if a.paired else ""
    stem = _new_stem(f"step-cuts-{a.model}{turns}-{time.strftime('%Y-%m-%d')}")
    (RESULTS / f"{stem}.md").write_text(text)
    (RESULTS / f"{stem}.json").write_text(json.dumps({"runs": runs, "median": med}, indent=1))
    print(text)


if __name__ == "__main__":
    main()
