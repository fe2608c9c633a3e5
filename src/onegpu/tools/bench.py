"""`onegpu bench`: the ablation grids of our source documents (docs/sources.md), measured on
this device, as table, JSON and plot.

Every row is a real `onegpu train` run in a fresh process (the CPU's peak RSS is a lifetime
maximum, and compile caches or allocator state must not leak between rows) on the same data,
initialisation and global batch. A row reports:
- step_time_s / tokens_per_s: median over the steps after the third (the first compiles and
  warms up, the second is profiled for memory, the third pays for the profiler's teardown);
- peak_mem_bytes: on CUDA the allocator's peak; on CPU the tensor bytes at the step's peak from
  the profiler's memory timeline (peak_rss_bytes, the process view, is kept beside it);
- loss: training loss of the last step; compile_time_s for compiled rows.

Writes DIR/bench.md, DIR/bench.json (a list of rows) and DIR/bench.png (names are a contract).
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from onegpu.config import ConfigError, load_toml
from onegpu.runs.atomic import write_together
from onegpu.tools.bench_backend import for_backend, refused
from onegpu.tools.bench_grids import GRID_ALIASES, GRIDS, Row  # noqa: F401 - bench's API
from onegpu.tools.processes import run_bounded, run_stopped

# Steps left out of the timing: 1 compiles/warms up, 2 is profiled for memory, 3 still pays
# for the profiler's teardown (measured here: 338 ms against a steady 25 ms on `tiny`).
WARM_STEPS = 3

# Hugging Face, "Efficient Training on a Single GPU": each technique alone, then everything.
# A row turns on what it names and nothing else: the `auto` loss chunk and compile are off.
VANILLA = {"train.precision": "fp32", "memory.loss_chunk": "0", "train.compile": "none"}


def grid_names(spec: str) -> list[str]:
    """`--grid`: 'all', or a comma-separated list of grid names (former names accepted)."""
    if spec == "all":
        return list(GRIDS)
    names = [GRID_ALIASES.get(g, g) for g in spec.split(",")]
    bad = [g for g in names if g not in GRIDS]
    if bad:
        raise ConfigError(
            "--grid", f"unknown grid {bad[0]!r}; choose all or from {', '.join(GRIDS)}"
        )
    return names


def check_rounds(steps: int, repeats: int) -> None:
    """--steps must leave steady steps after the warm-up; at least one round."""
    if steps <= WARM_STEPS:
        raise ConfigError(
            "--steps",
            f"needs more than {WARM_STEPS} (steps 1-{WARM_STEPS} warm up and are profiled), "
            f"got {steps}",
        )
    if repeats < 1:
        raise ConfigError("--repeats", f"must be at least 1 round, got {repeats}")


def _resolve(overrides: dict[str, str], base: dict[str, Any]) -> dict[str, str]:
    """'/4' means the base value divided by 4 (micro-batch sizes relative to the batch)."""
    out = {}
    for k, v in overrides.items():
        if isinstance(v, str) and v.startswith("/"):
            v = str(max(1, int(base[k]) // int(v[1:])))
        out[k] = str(v)
    return out


def load_grid_file(path: str) -> list[Row]:
    """A TOML file of [[row]] tables: name = "...", and an [row.overrides] table."""
    try:
        data = load_toml(Path(path))
    except ConfigError as e:
        raise ConfigError("--grid-file", str(e).split(": ", 1)[1]) from None
    try:
        rows = [
            (r["name"], {k: str(v) for k, v in r.get("overrides", {}).items()}) for r in data["row"]
        ]
    except (KeyError, TypeError, AttributeError) as e:
        raise ConfigError(
            "--grid-file", f"{path}: {e}; expected [[row]] tables with name and overrides"
        ) from None
    if not rows:
        raise ConfigError("--grid-file", f"{path} has no [[row]] entries")
    return rows


def run_row(
    preset: str | None,
    config_file: str | None,
    overrides: dict[str, str],
    steps: int,
    workdir: Path,
    nproc: int = 1,
    timeout_s: float | None = None,
    horizon: int | None = None,
) -> dict[str, Any]:
    """One `onegpu train` in a fresh process (`nproc` > 1: a `torchrun --standalone` launch of
    that many); the row's measurements from its run folder. `timeout_s`: the process is killed
    after that long and the row fails (a suite that must end inside a device lease).
    `horizon`: the run is set to that many steps, which `auto` decides by (compile repays only
    a long run), and stopped gracefully (SIGTERM) once `steps` steps are logged."""
    out = Path(tempfile.mkdtemp(dir=workdir))
    cmd = train_command(preset, config_file, overrides, horizon or steps, out, nproc)
    t0 = time.perf_counter()
    try:
        returncode, stderr = _run_train(cmd, out, steps if horizon else None, timeout_s)
    except subprocess.TimeoutExpired:
        raise RuntimeError(f"{' '.join(cmd)}\nkilled after {timeout_s:.0f} s") from None
    if returncode != 0:  # a rank's own cause sits above torchrun's report: keep it
        lines = stderr.strip().splitlines()
        causes = [
            x
            for x in lines[:-15]
            if "terminate called" in x or "what():" in x or "Error" in x or "error:" in x
        ][-5:]
        tail = "\n".join(causes + lines[-15:])
        raise RuntimeError(f"{' '.join(cmd)}\nfailed with exit code {returncode}:\n{tail}")
    row = measured_row(out)
    return {"overrides": overrides, **row, "wall_s": time.perf_counter() - t0}


def _run_train(
    cmd: list[str], out: Path, stop_after: int | None, timeout_s: float | None
) -> tuple[int, str]:
    """Run `cmd` (exit code, stderr), or with `stop_after`, stop it gracefully after that many
    steps; past `timeout_s` it is killed with everything it started (TimeoutExpired)."""
    if stop_after is None:
        proc = run_bounded(cmd, timeout_s)
        return proc.returncode, proc.stderr
    return run_stopped(cmd, out / "metrics.jsonl", stop_after, timeout_s)


def train_command(
    preset: str | None,
    config_file: str | None,
    overrides: dict[str, str],
    steps: int,
    out: Path,
    nproc: int = 1,
) -> list[str]:
    """The command line of one row: a short run, logged every step, memory measured."""
    cmd = [sys.executable, "-m", "onegpu", "train"]
    if nproc > 1:
        launch = ["torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"]
        cmd = [sys.executable, "-m", *launch, "-m", "onegpu", "train"]
    if preset:
        cmd += ["--preset", preset]
    if config_file:
        cmd += ["--config", config_file]
    fixed = {
        "train.max_steps": str(steps),
        "train.log_every": "1",
        "train.eval_every": "0",
        "train.measure_memory": "true",
        "out.progress": "false",
        "out.save_checkpoint": "false",
        "out.dir": str(out),
    }
    for k, v in {**fixed, **overrides}.items():
        cmd += [f"--{k}", v]
    return cmd


def measured_row(out: Path) -> dict[str, Any]:
    """A row's figures from its run folder: the median steady step, the measured peak."""
    summary = json.loads((out / "summary.json").read_text())
    metrics = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    times = [m["step_time_s"] for m in metrics if "step_time_s" in m and m["step"] > WARM_STEPS]
    if not times:
        raise RuntimeError(f"no steady steps measured; raise --steps above {WARM_STEPS}")
    step_time = statistics.median(times)
    mem = summary.get("memory") or {}
    cuda = summary["device"].startswith("cuda")
    if cuda:
        peak, kind = summary["peak_mem_bytes"], summary["peak_mem_kind"]
    else:  # the tracked peak of the measured step (RSS holds the interpreter and libraries too)
        peak, kind = mem.get("peak"), mem.get("kind")
    if "dist" in summary:  # the process that peaked highest (rank 0 holds the unsharded root)
        peak = max(r["peak_mem_bytes"] for r in summary["dist"]["per_rank"])
        kind = f"highest of {summary['dist']['world_size']} ranks' {summary['peak_mem_kind']}"
    trained = summary.get("trained_tokens")  # the tokens the loss counts (masks, padding)
    return {
        "tokens_per_s": summary["tokens"] / summary["steps"] / step_time,
        "trained_tokens_per_s": trained / summary["steps"] / step_time if trained else None,
        "step_time_s": step_time,
        "peak_mem_bytes": peak,
        "peak_mem_kind": kind,
        "peak_rss_bytes": None if cuda else summary["peak_mem_bytes"],
        "memory": {k: mem.get(k) for k in ("params", "grads", "optimizer", "activations", "other")},
        "saved_activations_per_micro_batch": mem.get("saved_activations_per_micro_batch"),
        "loss": summary["loss"],
        "offload": summary.get("offload"),
        "compile_time_s": summary.get("compile_time_s"),
        "compile": summary["config"]["train"]["compile"],  # what `auto` decided
        "compile_auto": summary.get("compile_auto"),  # and from what (None: not auto)
        "kernels": kernels_chosen(summary["config"]),
        "mfu": summary.get("mfu"),
        "precision": summary["precision"],
        "model": _model_line(summary),
        "device": summary["device_name"],
    }


def kernels_chosen(config: dict[str, Any]) -> dict[str, Any]:
    """The kernels a run's or a plan's config settled on, which its memory depends on."""
    flat = config["model"] | config["memory"] | config["train"] if "model" in config else config
    return {
        "attention": flat.get("attention"),
        "loss_chunk": flat.get("loss_chunk"),
        "loss_kernel": flat.get("loss_kernel"),
    }


def _model_line(summary: dict[str, Any]) -> str:
    m, d = summary["config"]["model"], summary["config"]["data"]
    where = f" ({m['hf']}, seq {d['seq_len'] or m['seq_len']})" if m.get("hf") else ""
    return (
        f"{m['n_layer']} layers x d{m['d_model']}, {m['n_head']} heads, vocab {m['vocab_size']}"
        f"{where}"
    )


def bench(
    *,
    grids: list[str],
    grid_rows: list[Row] | None,
    preset: str | None,
    config_file: str | None,
    base_overrides: dict[str, str],
    steps: int,
    out_dir: Path,
    repeats: int = 2,
    log=print,
) -> list[dict[str, Any]]:
    """Run the grids and write the three files. Distinct configurations run once per round,
    rounds are interleaved (a slow moment of a shared machine hits every row alike), and each
    row reports medians over rounds (docs/architecture.md: honest numbers)."""
    from onegpu.config import load_config

    base_cfg = load_config(preset, config_file, base_overrides)  # validates the base: exit 2
    base_values = {"train.micro_batch_size": base_cfg.train.batch_size}
    sections = {"custom": grid_rows} if grid_rows else {g: GRIDS[g] for g in grids}
    base = {**VANILLA, "train.micro_batch_size": str(base_cfg.train.batch_size), **base_overrides}
    backend = base_cfg.train.backend
    entries = [
        (grid, name, for_backend({**base, **_resolve(overrides, base_values)}, backend))
        for grid, rows_ in sections.items()
        for name, overrides in rows_
    ]
    if backend != "torch":  # rows without a counterpart there are left out, and said so
        skipped = [(g, n, why) for g, n, c in entries if (why := refused(preset, config_file, c))]
        for grid, name, why in skipped:
            log(f"{grid}: {name}: skipped on {backend} ({why})")
        entries = [e for e in entries if (e[0], e[1]) not in {(g, n) for g, n, _ in skipped}]
    configs = {json.dumps(c, sort_keys=True): c for _, _, c in entries}
    runs: dict[str, list[dict[str, Any]]] = {k: [] for k in configs}
    with tempfile.TemporaryDirectory() as workdir:
        for r in range(repeats):
            for key, config in configs.items():
                res = run_row(preset, config_file, config, steps, Path(workdir))
                runs[key].append(res)
                log(
                    f"round {r + 1}/{repeats}: "
                    + ", ".join(f"{n}" for _, n, c in entries if c is config or c == config)
                    + f": {res['tokens_per_s']:,.0f} tokens/s, peak {_mib(res['peak_mem_bytes'])}"
                )
    rows = [
        {"grid": grid, "name": name, **_median(runs[json.dumps(c, sort_keys=True)])}
        for grid, name, c in entries
    ]
    command = "onegpu " + " ".join(sys.argv[1:]) if sys.argv and "onegpu" in sys.argv[0] else ""
    write_together(
        out_dir,
        {
            "bench.json": json.dumps(rows, indent=1) + "\n",
            "bench.md": markdown(rows, base_cfg, steps, repeats, command),
            "bench.png": lambda path: plot(rows, path),
        },
    )
    return rows


def _median(results: list[dict[str, Any]]) -> dict[str, Any]:
    """Medians of the numbers over rounds; the rest from the first round; tokens/s per round."""
    out = dict(results[0])
    for k, v in results[0].items():
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            out[k] = statistics.median(r[k] for r in results)
    out["tokens_per_s_rounds"] = [r["tokens_per_s"] for r in results]
    if results[0].get("compile_time_s") is not None:
        out["compile_time_cold_s"] = results[0]["compile_time_s"]
    return out


def _mib(b: int | None) -> str:
    return "n/a" if b is None else f"{b / 2**20:,.0f} MiB"


def markdown(rows: list[dict[str, Any]], cfg, steps: int, repeats: int, command: str) -> str:
    m = cfg.model
    model = f"{m.n_layer} layers x d{m.d_model}, {m.n_head} heads, vocab {m.vocab_size}"
    models = sorted({r.get("model") for r in rows} - {None, model})
    shown = models if models and all(r.get("model") != model for r in rows) else [model, *models]
    lines = [
        "# onegpu bench",
        "",
        f"Model: {' / '.join(shown)}, "
        f"seq {cfg.train_seq_len} unless stated; batch {cfg.train.batch_size} sequences per step; "
        f"{steps} steps per row (median of steps {WARM_STEPS + 1}..{steps}); medians of "
        f"{repeats} interleaved round(s).  ",
        f"Device: {rows[0]['device'] if rows else '?'}; {platform.machine()}, "
        f"{os.cpu_count()} CPUs; {time.strftime('%Y-%m-%d %H:%M')}.  ",
    ]
    if command:
        lines.append(f"Command: `{command}`  ")
    for grid in dict.fromkeys(r["grid"] for r in rows):
        part = [r for r in rows if r["grid"] == grid]
        ref = part[0]
        lines += [
            "",
            f"## {grid}",
            "",
            "| configuration | tokens/s | x first row | step time | peak memory | x first row "
            "| loss | compile |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for r in part:
            mem_ratio = (
                f"{r['peak_mem_bytes'] / ref['peak_mem_bytes']:.2f}"
                if r["peak_mem_bytes"] and ref["peak_mem_bytes"]
                else "n/a"
            )
            comp = (
                f"{r['compile_time_cold_s']:.1f} s first round, median {r['compile_time_s']:.1f} s"
                if r.get("compile_time_cold_s") is not None
                else ""
            )
            lines.append(
                f"| {r['name']} | {r['tokens_per_s']:,.0f} | "
                f"{r['tokens_per_s'] / ref['tokens_per_s']:.2f} | {r['step_time_s'] * 1e3:,.0f} ms "
                f"| {_mib(r['peak_mem_bytes'])} | {mem_ratio} | {r['loss']:.3f} | {comp} |"
            )
    kind = rows[0]["peak_mem_kind"] if rows else ""
    lines += ["", f"Peak memory: {kind}.", ""]
    return "\n".join(lines)


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [f"[{r['grid']}] {r['name']}" for r in rows]
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(13, 0.45 * len(rows) + 1.5), sharey=True)
    y = range(len(rows))
    a1.barh(y, [r["tokens_per_s"] for r in rows], color="tab:blue")
    a1.set_xlabel("tokens/s (higher is better)")
    a2.barh(y, [(r["peak_mem_bytes"] or 0) / 2**20 for r in rows], color="tab:red")
    a2.set_xlabel("peak memory, MiB (lower is better)")
    a1.set_yticks(list(y), labels, fontsize=8)
    a1.invert_yaxis()
    fig.tight_layout()
    fig.savefig(path, dpi=100, format="png")
    plt.close(fig)
