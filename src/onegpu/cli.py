"""The `onegpu` command: subcommands map to library functions; no logic of its own."""

from __future__ import annotations

import argparse
import difflib
import json
import os
import signal
import sys
import warnings
from collections.abc import Sequence

from onegpu.config import ConfigError, all_fields, all_keys, load_config, preset_names, type_name

EPILOG = """Every option is --section.field VALUE (booleans: true/false). Precedence:
--preset < --config FILE < command line. The resolved config is written to the run folder."""


def _add_config_options(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--preset", help=f"named starting point: {', '.join(preset_names())} (default: small)"
    )
    p.add_argument("--config", metavar="FILE", help="TOML file with [section] tables of options")
    p.add_argument("--out", metavar="DIR", help="run folder (same as --out.dir)")
    groups: dict[str, argparse._ArgumentGroup] = {}
    for section, name, typ, default, doc in all_fields():
        g = groups.setdefault(section, p.add_argument_group(f"[{section}]"))
        g.add_argument(
            f"--{section}.{name}",
            dest=f"{section}.{name}",
            metavar=type_name(typ).upper() if "{" not in type_name(typ) else type_name(typ),
            default=argparse.SUPPRESS,
            help=f"{doc} (default: {default!r})".replace("%", "%%"),
        )


def _overrides(ns: argparse.Namespace, unknown: list[str]) -> dict[str, str]:
    if unknown:
        bad = unknown[0].split("=")[0]
        key = bad.lstrip("-")
        hint = difflib.get_close_matches(key, all_keys(), n=1, cutoff=0.6)
        fix = f"did you mean --{hint[0]}?" if hint else "see --help for the options"
        raise ConfigError(key, f"unknown option {bad}; {fix}")
    values = {k: v for k, v in vars(ns).items() if "." in k}
    if ns.out:
        values.setdefault("out.dir", ns.out)
    return values


def _config_from(ns: argparse.Namespace, unknown: list[str]):
    return load_config(ns.preset, ns.config, _overrides(ns, unknown))


def cmd_train(ns: argparse.Namespace, unknown: list[str]) -> int:
    from onegpu.train.oom import TrainingOutOfMemory
    from onegpu.train.trainer import train

    cfg = _config_from(ns, unknown)
    try:
        summary = train(cfg)
    except TrainingOutOfMemory as e:
        from onegpu.tools.oom import explain

        raise ConfigError("out of memory", explain(cfg, e)) from None
    if summary["interrupted"]:  # stopped by a signal: checkpoint and summary are written
        print(f"onegpu: stopped by {summary['signal']} after step {summary['steps']}; "
              "continue with --train.resume auto", file=sys.stderr)  # fmt: skip
        return 128 + signal.Signals[summary["signal"]].value
    if summary["diverged"]:
        print(f"onegpu: stopped at step {summary['steps']}: "
              f"{cfg.train.max_consecutive_skips} updates in a row had a non-finite loss or "
              "gradient (skipped, so the weights and the last checkpoint are from before); "
              "lower optim.lr, or raise optim.warmup_steps or optim.grad_clip", file=sys.stderr)  # fmt: skip
        return 1
    keys = (
        "params",
        "tokens",
        "tokens_per_s",
        "mfu",
        "peak_mem_bytes",
        "loss",
        "val_loss",
        "train_time_s",
    )
    if os.environ.get("RANK", "0") == "0":
        print(json.dumps({k: summary[k] for k in keys}, indent=1))
    return 0


def cmd_profile(ns: argparse.Namespace, unknown: list[str]) -> int:
    from onegpu.tools.profile import profile

    if ns.steps < 1:
        raise ConfigError("--steps", f"must be at least 1 profiled step, got {ns.steps}")
    if ns.warmup < 0:
        raise ConfigError("--warmup", f"must be >= 0, got {ns.warmup}")
    result = profile(_config_from(ns, unknown), steps=ns.steps, warmup=ns.warmup)
    print(result["summary"].split("top operations")[0].rstrip())
    out = result["out_dir"]
    print(f"\nwrote {out}/trace.json, {out}/memory.html (+ .png), {out}/summary.txt")
    return 0


def cmd_bench(ns: argparse.Namespace, unknown: list[str]) -> int:
    from pathlib import Path

    from onegpu.tools.bench import GRIDS, WARM_STEPS, bench, load_grid_file

    overrides = _overrides(ns, unknown)
    overrides.pop("out.dir", None)  # --out is where the bench files go, not a run folder
    names = list(GRIDS) if ns.grid == "all" else ns.grid.split(",")
    bad = [g for g in names if g not in GRIDS]
    if bad:
        raise ConfigError(
            "--grid", f"unknown grid {bad[0]!r}; choose all or from {', '.join(GRIDS)}"
        )
    if ns.steps <= WARM_STEPS:
        raise ConfigError(
            "--steps",
            f"needs more than {WARM_STEPS} (steps 1-{WARM_STEPS} warm up and are profiled), "
            f"got {ns.steps}",
        )
    if ns.repeats < 1:
        raise ConfigError("--repeats", f"must be at least 1 round, got {ns.repeats}")
    out = Path(ns.out or "bench")
    bench(
        grids=names,
        grid_rows=load_grid_file(ns.grid_file) if ns.grid_file else None,
        preset=ns.preset,
        config_file=ns.config,
        base_overrides=overrides,
        steps=ns.steps,
        out_dir=out,
        repeats=ns.repeats,
    )
    print(f"wrote {out}/bench.md, {out}/bench.json, {out}/bench.png")
    return 0


def cmd_plan(ns: argparse.Namespace, unknown: list[str]) -> int:
    from onegpu.perf.devices import GPUS
    from onegpu.tools.plan import format_report, plan_report

    if ns.gpu == "list":
        print("name        memory   peak dense TFLOP/s (fp32 / tf32 / bf16 / fp16)")
        for g in GPUS.values():
            tf = "/".join(
                f"{g.peak[k] / 1e12:g}" if k in g.peak else "-"
                for k in ("fp32", "tf32", "bf16", "fp16")
            )
            print(f"{g.name:<10} {g.memory_bytes / 2**30:5.0f} GiB   {tf}")
        return 0
    if ns.memory is not None and ns.memory <= 0:
        raise ConfigError("--memory", f"must be a positive number of bytes, got {ns.memory}")
    report = plan_report(_config_from(ns, unknown), ns.gpu, ns.memory, ns.world_size)
    print(json.dumps(report, indent=1) if ns.json else format_report(report, ns.gpu))
    return 0


def cmd_tune(ns: argparse.Namespace, unknown: list[str]) -> int:
    from pathlib import Path

    import torch

    from onegpu.perf.devices import GPUS
    from onegpu.tools.plan import CUDA_OVERHEAD_BYTES
    from onegpu.tools.tune import tune

    overrides = _overrides(ns, unknown)
    overrides.pop("out.dir", None)  # --out is where the tune files go
    cfg = load_config(ns.preset, ns.config, overrides)
    if ns.gpu is not None:
        if ns.gpu not in GPUS:
            raise ConfigError(
                "--gpu", f"unknown GPU {ns.gpu!r}; `onegpu plan --gpu list` shows the table"
            )
        budget = GPUS[ns.gpu].memory_bytes - CUDA_OVERHEAD_BYTES
    elif ns.memory is not None:
        if ns.memory <= 0:
            raise ConfigError("--memory", f"must be a positive number of bytes, got {ns.memory}")
        budget = ns.memory
    elif torch.cuda.is_available():
        budget = torch.cuda.get_device_properties(0).total_memory - CUDA_OVERHEAD_BYTES
    else:
        raise ConfigError("--memory", "on a CPU give the budget in bytes, e.g. --memory 4000000000")
    out = Path(ns.out or "tune")
    result = tune(
        cfg,
        budget_bytes=budget,
        target="cuda" if torch.cuda.is_available() else "cpu",
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
    launch = (
        "onegpu train"
        if ns.world_size == 1
        else (f"torchrun --nproc-per-node {ns.world_size} -m onegpu train")
    )
    print(f"wrote {out}/tune.md, {out}/tune.json, {out}/tune.png, {out}/best.toml "
          f"({launch} --config {out}/best.toml)")  # fmt: skip
    return 0 if result["best"] else 2


def _no_unknown(command: str, unknown: list[str]) -> None:
    if unknown:
        raise ConfigError(unknown[0], f"unknown option for `onegpu {command}`; see --help")


def cmd_export(ns: argparse.Namespace, unknown: list[str]) -> int:
    from onegpu.tools.export import export

    _no_unknown("export", unknown)
    result = export(ns.run_dir, ns.out, overwrite=ns.overwrite)
    print(json.dumps(result, indent=1))
    return 0


def cmd_generate(ns: argparse.Namespace, unknown: list[str]) -> int:
    from onegpu.tools.generate import generate

    _no_unknown("generate", unknown)
    text = generate(
        ns.source,
        ns.prompt,
        max_new_tokens=ns.max_new_tokens,
        temperature=ns.temperature,
        top_k=ns.top_k,
        seed=ns.seed,
    )
    print(ns.prompt + text)
    return 0


def cmd_plot(ns: argparse.Namespace, unknown: list[str]) -> int:
    from onegpu.tools.plot import plot_runs

    _no_unknown("plot", unknown)
    out = plot_runs(ns.run_dirs, ns.out)
    print(f"wrote {out}")
    return 0


def cmd_info(ns: argparse.Namespace, unknown: list[str]) -> int:
    if unknown:
        raise ConfigError(unknown[0], "unknown option for `onegpu info`")
    from onegpu.tools.info import device_info, format_info

    info = device_info(measure=not ns.no_measure, refresh=ns.refresh)
    print(json.dumps(info, indent=1) if ns.json else format_info(info))
    return 0


class _Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one line like every other bad input (not a usage dump)."""

    def error(self, message: str):
        raise ConfigError("command line", f"{message}; see `{self.prog} --help`")


def make_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="onegpu",
        description="Train transformer language models efficiently on one GPU or a CPU.",
    )
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    p = sub.add_parser(
        "train",
        allow_abbrev=False,
        help="train a model (defaults: a small GPT on the Python standard library)",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _add_config_options(p)
    p.set_defaults(func=cmd_train)
    p = sub.add_parser(
        "profile",
        allow_abbrev=False,
        help="profile a few training steps: trace, memory timeline, summary of where time goes",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--steps", type=int, default=3, help="profiled steps (default: 3)")
    p.add_argument(
        "--warmup", type=int, default=2, help="steps run first, not recorded (default: 2)"
    )
    _add_config_options(p)
    p.set_defaults(func=cmd_profile)
    p = sub.add_parser(
        "plan",
        allow_abbrev=False,
        help="predict a step's memory (any model, any GPU) before anything runs",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--gpu", help="a GPU of the table (e.g. A100-40, RTX4090), or 'list'")
    p.add_argument("--memory", type=int, help="a memory budget in bytes (e.g. this machine's RAM)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument(
        "--world-size",
        type=int,
        default=1,
        metavar="N",
        help="plan one of N processes under torchrun (--dist.strategy fsdp|ddp; auto: fsdp)",
    )
    _add_config_options(p)
    p.set_defaults(func=cmd_plan)
    p = sub.add_parser(
        "tune",
        allow_abbrev=False,
        help="the fastest configuration that fits a memory budget (planned, then measured)",
        epilog=EPILOG + " Options set the starting configuration; the global batch is kept.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--gpu", help="budget: a GPU of the table (onegpu plan --gpu list)")
    p.add_argument("--memory", type=int, help="budget in bytes (on a CPU: required)")
    p.add_argument(
        "--time-budget", type=float, default=300, help="seconds of measured trials (default: 300)"
    )
    p.add_argument("--steps", type=int, default=6, help="steps per trial (default: 6)")
    p.add_argument("--with-compile", action="store_true", help="also try regional compile")
    p.add_argument(
        "--world-size",
        type=int,
        default=1,
        metavar="N",
        help="tune one of N processes under torchrun: the strategy joins the search, the "
        "budget is per process, trials launch N processes",
    )
    _add_config_options(p)
    p.set_defaults(func=cmd_tune)
    p = sub.add_parser(
        "bench",
        allow_abbrev=False,
        help="ablation grids of the source documents on this device: bench.md, .json, .png",
        epilog=EPILOG + " Options set the base configuration of every row.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--grid",
        default="all",
        help="all, or a comma-separated list of: hf (HF's single-GPU guide on the GPT), hf-bert "
        "(the guide's rows on a scaled-down BERT classifier, as the guide measured), seed000 "
        "(Lippe), seed003 (Optimising the Training Loop)",
    )
    p.add_argument(
        "--grid-file",
        metavar="FILE",
        help="TOML with [[row]] tables (name, [row.overrides]) instead of the built-in grids",
    )
    p.add_argument("--steps", type=int, default=8, help="training steps per row (default: 8)")
    p.add_argument(
        "--repeats",
        type=int,
        default=2,
        help="interleaved rounds; rows report medians (default: 2)",
    )
    _add_config_options(p)
    p.set_defaults(func=cmd_bench)
    p = sub.add_parser(
        "export", help="a run's weights as a Hugging Face folder (from_pretrained loads it)"
    )
    p.add_argument("run_dir", metavar="RUN_DIR", help="a run folder (its final or newest weights)")
    p.add_argument("--out", required=True, metavar="FOLDER", help="the Hugging Face folder")
    p.add_argument("--overwrite", action="store_true", help="write into a non-empty folder")
    p.set_defaults(func=cmd_export)
    p = sub.add_parser("generate", help="sample text from a run or a Hugging Face folder")
    p.add_argument("source", metavar="RUN_DIR_OR_HF_FOLDER")
    p.add_argument("--prompt", default="", help="the text to continue (default: empty)")
    p.add_argument("--max-new-tokens", type=int, default=100, help="default: 100")
    p.add_argument("--temperature", type=float, default=0.8, help="0: greedy (default: 0.8)")
    p.add_argument("--top-k", type=int, default=50, help="0: no cut (default: 50)")
    p.add_argument("--seed", type=int, default=0, help="same seed, same text (default: 0)")
    p.set_defaults(func=cmd_generate)
    p = sub.add_parser("plot", help="loss against steps and tokens for one or more runs (PNG)")
    p.add_argument("run_dirs", nargs="+", metavar="RUN_DIR")
    p.add_argument("--out", default="loss.png", help="the PNG to write (default: loss.png)")
    p.set_defaults(func=cmd_plot)
    p = sub.add_parser(
        "info", help="device, torch version, supported dtypes, measured matmul peaks"
    )
    p.add_argument("--json", action="store_true", help="print JSON")
    p.add_argument("--no-measure", action="store_true", help="skip the matmul peak measurement")
    p.add_argument(
        "--refresh",
        action="store_true",
        help="measure the CPU's matmul peaks again (MFU's denominator) instead of the cached ones",
    )
    p.set_defaults(func=cmd_info)
    return parser


def _show_warning(message, category, filename, lineno, file=None, line=None) -> None:
    """onegpu's own warnings as one line, like its errors; others as Python shows them."""
    if "onegpu" in str(filename):
        print(f"onegpu: warning: {message}", file=sys.stderr)
    else:
        sys.stderr.write(warnings.formatwarning(message, category, filename, lineno, line))


def main(argv: Sequence[str] | None = None) -> int:
    warnings.showwarning = _show_warning
    if os.environ.get("RANK", "0") != "0":  # under torchrun, rank 0 speaks for every process
        warnings.simplefilter("ignore")
    try:
        ns, unknown = make_parser().parse_known_args(argv)
        return ns.func(ns, unknown)
    except ConfigError as e:
        if os.environ.get("RANK", "0") == "0":  # under torchrun: one message, not one per process
            print(f"onegpu: error: {e}", file=sys.stderr)
        return 2


def entry() -> None:
    """The `onegpu` command: the process-level defaults for the device, then main()."""
    from onegpu.perf import allocator

    if len(sys.argv) > 1 and sys.argv[1] in ("train", "bench", "profile", "tune"):
        allocator.maybe_reexec_with_fast_allocator(sys.argv[1:])
        allocator.apply()  # where nothing was preloaded: glibc tuned in this process
    try:
        code = main()
        sys.stdout.flush()
    except BrokenPipeError:  # the reader went away (`onegpu plan --gpu list | head`): fine
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        code = 0
    sys.exit(code)


if __name__ == "__main__":  # pragma: no cover
    entry()
