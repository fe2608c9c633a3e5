"""The subcommands, declared as data: each a name, a help line, its own arguments, whether it
takes the config options, and the handler that calls the library. Handlers hold no policy:
checks of their arguments live with the functions they call."""

from __future__ import annotations

import json
import signal
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from onegpu.cli.arguments import GRID_HELP, PLAN_ARGS, TUNE_ARGS, Arg, _a
from onegpu.config import Config, ConfigError
from onegpu.runs.atomic import write_text_atomic
from onegpu.runs.sinks import strict


@dataclass(frozen=True)
class Command:
    name: str
    help: str
    run: Callable[..., int]
    """run(ns, cfg or overrides, env) -> exit code."""
    args: tuple[Arg, ...] = ()
    config: bool = False
    """Takes --preset, --config, --out and every --section.field option."""
    epilog: str = ""
    own_out: bool = False
    """--out is the command's own output folder, not a run folder (out.dir)."""


@dataclass(frozen=True)
class Env:
    """The environment, read once by main()."""

    rank0: bool = True
    """This process speaks (not a non-zero rank under torchrun)."""
    load: Callable[..., Config] | None = field(default=None, repr=False)
    """The config of the command line (preset < file < options)."""


def _train(ns, env: Env) -> int:
    from onegpu.train import train  # imports the backend train.backend names, no other

    cfg = env.load()
    return _report(cfg, env, train(cfg))


def _report(cfg: Config, env: Env, summary: dict[str, Any]) -> int:
    """The run's end: its summary on stdout, or why it stopped early (and the exit code)."""
    if summary["interrupted"]:  # stopped by a signal: checkpoint and summary are written
        print(
            f"onegpu: stopped by {summary['signal']} after step {summary['steps']}; "
            "continue with --train.resume auto",
            file=sys.stderr,
        )
        return 128 + signal.Signals[summary["signal"]].value
    if summary["diverged"]:
        good = summary.get("last_good_checkpoint")
        kept = (
            f"the last checkpoint from before them is kept: {good}"
            if good
            else "no checkpoint was written before them"
        )
        print(
            f"onegpu: stopped at step {summary['steps']}: "
            f"{cfg.train.max_consecutive_skips} updates in a row had a non-finite loss or "
            f"gradient (skipped); {kept}; lower optim.lr, or raise optim.warmup_steps or "
            "optim.grad_clip",
            file=sys.stderr,
        )
        return 1
    keys = (
        "params",
        "tokens",
        "tokens_per_s",
        "mfu",
        "step_over_floor",
        "peak_mem_bytes",
        "loss",
        "val_loss",
        "train_time_s",
    )
    if env.rank0:  # strict JSON: a run of no steps has no loss (null, not NaN)
        shown = {k: summary[k] for k in keys}
        if "trained_tokens" in summary:  # instruction and chat data: the tokens that carry loss
            shown["trained_tokens"] = summary["trained_tokens"]
            shown["trained_tokens_per_s"] = summary["trained_tokens_per_s"]
        print(json.dumps(strict(shown), indent=1, allow_nan=False))
    return 0


def _profile(ns, env: Env) -> int:
    cfg = env.load()
    if cfg.train.backend == "jax":  # imports no torch
        from onegpu.backends.jax.profile import profile_jax

        result = profile_jax(cfg, steps=ns.steps, warmup=ns.warmup)
        print(result["summary"], end="")
        print(f"\nwrote {result['out_dir']}/summary.txt and the trace above")
        return 0
    from onegpu.tools.profile import profile

    result = profile(cfg, steps=ns.steps, warmup=ns.warmup)
    print(result["summary"].split("top operations")[0].rstrip())
    out = result["out_dir"]
    print(f"\nwrote {out}/trace.json, {out}/memory.html (+ .png), {out}/summary.txt")
    return 0


def _bench(ns, env: Env) -> int:
    from onegpu.tools.bench import bench, check_rounds, grid_names, load_grid_file

    names = grid_names(ns.grid)
    check_rounds(ns.steps, ns.repeats)
    out = Path(ns.out or "bench")
    bench(
        grids=names,
        grid_rows=load_grid_file(ns.grid_file) if ns.grid_file else None,
        preset=ns.preset,
        config_file=ns.config,
        base_overrides=env.load(overrides_only=True),
        steps=ns.steps,
        out_dir=out,
        repeats=ns.repeats,
    )
    print(f"wrote {out}/bench.md, {out}/bench.json, {out}/bench.png")
    return 0


def _plan(ns, env: Env) -> int:
    from onegpu.optim.host_step import priced_for

    with priced_for(_host_cpus(ns)):
        return _plan_priced(ns, env)


def _table_gpu(gpu: str | None) -> str | None:
    """--gpu as the table names it (h200, H200 or "NVIDIA H200" -> H200-141)."""
    from onegpu.perf.devices import table_gpu

    return table_gpu(gpu) if gpu is not None else None


def _host_cpus(ns) -> int | None:
    if ns.host_cpus is not None and ns.host_cpus < 1:
        raise ConfigError("--host-cpus", f"must be at least 1 core, got {ns.host_cpus}")
    return ns.host_cpus


def _plan_priced(ns, env: Env) -> int:
    from onegpu.plan.format import format_report
    from onegpu.plan.report import gpu_table, plan_report

    if ns.gpu == "list":
        print(gpu_table())
        return 0
    ns.gpu = _table_gpu(ns.gpu)
    if ns.largest:
        from onegpu.plan.largest import find_largest, format_largest

        found = find_largest(
            env.load(), ns.gpu, ns.memory, ns.host_memory, log=lambda line: print(line, flush=True)
        )
        print(json.dumps(found, indent=1) if ns.json else format_largest(found))
        return 0
    report = plan_report(
        env.load(), ns.gpu, ns.memory, ns.world_size, ns.host_memory, ns.interconnect
    )
    print(json.dumps(report, indent=1) if ns.json else format_report(report, ns.gpu))
    best = next((f["best_toml"] for f in report.get("fixes", []) if "best_toml" in f), None)
    best = best or (report.get("mesh_fixes", {}).get("best") or {}).get("best_toml")
    if ns.best_toml and best:
        write_text_atomic(Path(ns.best_toml), best)
        print(f"wrote {ns.best_toml} (onegpu train --config {ns.best_toml})")
    return 0


def _tune(ns, env: Env) -> int:
    from onegpu.optim.host_step import priced_for

    with priced_for(_host_cpus(ns)):
        return _tune_priced(ns, env)


def _tune_priced(ns, env: Env) -> int:
    from onegpu.tools.tune import budget, launch_line, predicted_only, tune

    ns.gpu = _table_gpu(ns.gpu)
    overrides = env.load(overrides_only=True)
    cfg = env.load()
    out = Path(ns.out or "tune")
    if predicted_only(ns.gpu, ns.memory):
        from onegpu.tools.tune_plan import tune_predicted

        tune_predicted(
            cfg,
            ns.gpu,
            ns.host_memory,
            out,
            world_size=ns.world_size,
            interconnect=ns.interconnect,
            log=lambda s: print(s, flush=True),
        )
        print((out / "tune.md").read_text())
        print(
            f"wrote {out}/tune.md, {out}/tune.json, {out}/best.toml "
            f"({launch_line(ns.world_size)} --config {out}/best.toml on {ns.gpu})"
        )
        return 0
    budget_bytes, target = budget(ns.gpu, ns.memory)
    result = tune(
        cfg,
        budget_bytes=budget_bytes,
        target=target,
        time_budget_s=ns.time_budget,
        steps=ns.steps,
        out_dir=out,
        preset=ns.preset,
        config_file=ns.config,
        base_overrides=overrides,
        with_compile=ns.with_compile,
        world_size=ns.world_size,
    )
    print((out / "tune.md").read_text())
    print(
        f"wrote {out}/tune.md, {out}/tune.json, {out}/tune.png, {out}/best.toml "
        f"({launch_line(ns.world_size)} --config {out}/best.toml)"
    )
    return 0 if result["best"] else 2


def _export(ns, env: Env) -> int:
    from onegpu.tools.export import export

    print(json.dumps(export(ns.run_dir, ns.out, overwrite=ns.overwrite), indent=1))
    return 0


def _generate(ns, env: Env) -> int:
    from onegpu.tools.generate import generate

    text = generate(
        ns.source,
        ns.prompt,
        max_new_tokens=ns.max_new_tokens,
        temperature=ns.temperature,
        top_k=ns.top_k,
        seed=ns.seed,
        chat=ns.chat,
    )
    print(text if ns.chat else ns.prompt + text)
    return 0


def _plot(ns, env: Env) -> int:
    from onegpu.tools.plot import plot_runs

    print(f"wrote {plot_runs(ns.run_dirs, ns.out)}")
    return 0


def _info(ns, env: Env) -> int:
    from onegpu.tools.info import device_info, format_info

    info = device_info(measure=not ns.no_measure, refresh=ns.refresh)
    print(json.dumps(info, indent=1) if ns.json else format_info(info))
    return 0


COMMANDS: tuple[Command, ...] = (
    Command(
        "train",
        "train a model (defaults: a small GPT on the Python standard library)",
        _train,
        config=True,
    ),
    Command(
        "profile",
        "profile a few training steps: trace, memory timeline, summary of where time goes",
        _profile,
        config=True,
        args=(
            _a("--steps", type=int, default=3, help="profiled steps (default: 3)"),
            _a("--warmup", type=int, default=2, help="steps run first, not recorded (default: 2)"),
        ),
    ),
    Command(
        "plan",
        "predict a step's memory (any model, any GPU) before anything runs",
        _plan,
        config=True,
        args=PLAN_ARGS,
    ),
    Command(
        "tune",
        "the fastest configuration that fits a memory budget (planned, then measured)",
        _tune,
        config=True,
        own_out=True,
        epilog=" Options set the starting configuration; the global batch is kept.",
        args=TUNE_ARGS,
    ),
    Command(
        "bench",
        "ablation grids of the source documents on this device: bench.md, .json, .png",
        _bench,
        config=True,
        own_out=True,
        epilog=" Options set the base configuration of every row.",
        args=(
            _a("--grid", default="all", help=GRID_HELP),
            _a(
                "--grid-file",
                metavar="FILE",
                help="TOML with [[row]] tables (name, [row.overrides]) instead of the built-in grids",
            ),
            _a("--steps", type=int, default=8, help="training steps per row (default: 8)"),
            _a(
                "--repeats",
                type=int,
                default=2,
                help="interleaved rounds; rows report medians (default: 2)",
            ),
        ),
    ),
    Command(
        "export",
        "a run's weights as a Hugging Face folder (from_pretrained loads it)",
        _export,
        args=(
            _a("run_dir", metavar="RUN_DIR", help="a run folder (its final or newest weights)"),
            _a("--out", required=True, metavar="FOLDER", help="the Hugging Face folder"),
            _a("--overwrite", action="store_true", help="write into a non-empty folder"),
        ),
    ),
    Command(
        "generate",
        "sample text from a run or a Hugging Face folder",
        _generate,
        args=(
            _a("source", metavar="RUN_DIR_OR_HF_FOLDER"),
            _a("--prompt", default="", help="the text to continue (default: empty)"),
            _a("--max-new-tokens", type=int, default=100, help="default: 100"),
            _a("--temperature", type=float, default=0.8, help="0: greedy (default: 0.8)"),
            _a("--top-k", type=int, default=50, help="0: no cut (default: 50)"),
            _a("--seed", type=int, default=0, help="same seed, same text (default: 0)"),
            _a("--chat", action="store_true", help="the prompt is a user's message: answer it"),
        ),
    ),
    Command(
        "plot",
        "loss against steps and tokens for one or more runs (PNG)",
        _plot,
        args=(
            _a("run_dirs", nargs="+", metavar="RUN_DIR"),
            _a("--out", default="loss.png", help="the PNG to write (default: loss.png)"),
        ),
    ),
    Command(
        "info",
        "device, torch version, supported dtypes, measured matmul peaks",
        _info,
        args=(
            _a("--json", action="store_true", help="print JSON"),
            _a("--no-measure", action="store_true", help="skip the matmul peak measurement"),
            _a(
                "--refresh",
                action="store_true",
                help="measure the CPU's matmul peaks again (MFU's denominator) instead of the cached ones",
            ),
        ),
    ),
)
