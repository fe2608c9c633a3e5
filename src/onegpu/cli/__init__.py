"""The `onegpu` command: the subcommands of commands.py on an argparse parser, config options
from the dataclasses' documentation, one-line errors with exit code 2. No logic of its own."""

from __future__ import annotations

import argparse
import contextlib
import difflib
import os
import signal
import sys
import warnings
from collections.abc import Sequence
from pathlib import Path

from onegpu.cli.commands import COMMANDS, Command, Env
from onegpu.config import ConfigError, all_fields, all_keys, load_config, preset_names, type_name
from onegpu.config.environment import error_file, rank_from_env
from onegpu.runs.signals import StopNow

EPILOG = """Every option is --section.field VALUE (booleans: true/false). Precedence:
--preset < --config FILE < command line. The resolved config is written to the run folder."""


class _Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one line like every other bad input (not a usage dump)."""

    def error(self, message: str):
        raise ConfigError("command line", f"{message}; see `{self.prog} --help`")


def _add_config_options(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--preset", help=f"named starting point: {', '.join(preset_names())} (default: small)"
    )
    p.add_argument("--config", metavar="FILE", help="TOML file with [section] tables of options")
    p.add_argument("--out", metavar="DIR", help="run folder (same as --out.dir)")
    groups: dict[str, argparse._ArgumentGroup] = {}
    for section, name, typ, default, doc in all_fields():
        g = groups.setdefault(section, p.add_argument_group(f"[{section}]"))
        shown = type_name(typ)
        g.add_argument(
            f"--{section}.{name}",
            dest=f"{section}.{name}",
            metavar=shown.upper() if "{" not in shown else shown,
            default=argparse.SUPPRESS,
            help=f"{doc} (default: {default!r})".replace("%", "%%"),
        )


def make_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="onegpu",
        description="Train transformer language models efficiently on one GPU or a CPU.",
    )
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    for c in COMMANDS:
        extra = (
            {"epilog": EPILOG + c.epilog, "formatter_class": argparse.RawDescriptionHelpFormatter}
            if c.config
            else {}
        )
        p = sub.add_parser(c.name, help=c.help, allow_abbrev=not c.config, **extra)
        for flags, kwargs in c.args:
            p.add_argument(*flags, **kwargs)
        if c.config:
            _add_config_options(p)
        p.set_defaults(command_spec=c)
    return parser


def _overrides(ns: argparse.Namespace, unknown: list[str], c: Command) -> dict[str, str]:
    """The --section.field values of the command line; an unknown option is refused with the
    closest known one."""
    if unknown:
        bad = unknown[0].split("=")[0]
        key = bad.lstrip("-")
        hint = difflib.get_close_matches(key, all_keys(), n=1, cutoff=0.6)
        fix = f"did you mean --{hint[0]}?" if hint else "see --help for the options"
        raise ConfigError(key, f"unknown option {bad}; {fix}")
    values = {k: v for k, v in vars(ns).items() if "." in k}
    if ns.out and not c.own_out:
        values.setdefault("out.dir", ns.out)
    return values


def _env(ns: argparse.Namespace, unknown: list[str], c: Command, rank0: bool) -> Env:
    if not c.config:
        if unknown:
            raise ConfigError(unknown[0], f"unknown option for `onegpu {c.name}`; see --help")
        return Env(rank0=rank0)

    def load(overrides_only: bool = False):
        values = _overrides(ns, unknown, c)
        return values if overrides_only else load_config(ns.preset, ns.config, values)

    return Env(rank0=rank0, load=load)


def _show_warning(message, category, filename, lineno, file=None, line=None) -> None:
    """onegpu's own warnings as one line, like its errors; others as Python shows them."""
    if "onegpu" in str(filename):
        print(f"onegpu: warning: {message}", file=sys.stderr)
    else:
        sys.stderr.write(warnings.formatwarning(message, category, filename, lineno, line))


def main(argv: Sequence[str] | None = None) -> int:
    rank0 = rank_from_env() == 0  # under torchrun, rank 0 speaks for every process
    warnings.showwarning = _show_warning
    if not rank0:
        warnings.simplefilter("ignore")
    try:
        ns, unknown = make_parser().parse_known_args(argv)
        c: Command = ns.command_spec
        return c.run(ns, _env(ns, unknown, c, rank0))
    except ConfigError as e:
        return _fail(f"onegpu: error: {e}", 2, rank0)  # under torchrun: rank 0 speaks
    except StopNow as e:  # a second Ctrl-C / SIGTERM: what was saved before is intact
        return _fail(
            f"onegpu: stopped at once by a second {signal.Signals(e.signum).name}; "
            "every checkpoint saved before it is intact (a save cut short leaves only "
            "a .tmp- folder, removed at the next start); continue with --train.resume "
            "auto",
            128 + e.signum,
            rank0,
        )
    except OSError as e:  # the machine, not the input: a full disk, a folder made read-only
        if e.filename is None:
            raise
        from onegpu.runs.folder import RunFolderWriteError

        resume = (
            (
                "; what was saved before is intact (an interrupted save leaves no partial "
                "file that a resume would load); fix this and continue with --train.resume "
                "auto"
            )
            if isinstance(e, RunFolderWriteError)
            else ""
        )
        return _fail(f"onegpu: error: {e.filename}: {e.strerror or e}{resume}", 1, True)


def _fail(line: str, code: int, speak: bool) -> int:
    """Print the one line (where this process speaks) and, under torchrun, leave it in the
    launcher's error file: torchrun's failure report then shows this line as the worker's
    cause instead of "To enable traceback see ..." (its own report around it is torchrun's)."""
    if speak:
        print(line, file=sys.stderr)
    if error_path := error_file():
        import json
        import time

        record = {
            "message": line,
            "extraInfo": {"py_callstack": line, "timestamp": str(int(time.time()))},
        }
        with contextlib.suppress(OSError):
            Path(error_path).write_text(json.dumps({"message": record}))
    return code


def entry() -> None:
    """The `onegpu` command: the process-level defaults for the device, then main()."""
    from onegpu.perf import allocator

    if len(sys.argv) > 1 and sys.argv[1] in ("train", "bench", "profile", "tune"):
        try:
            allocator.maybe_reexec_with_fast_allocator(sys.argv[1:])
            allocator.apply()  # where nothing was preloaded: glibc tuned in this process
        except ConfigError as e:  # ONEGPU_ALLOCATOR misspelt: before main(), same one line
            sys.exit(_fail(f"onegpu: error: {e}", 2, os.environ.get("RANK", "0") == "0"))
    try:
        code = main()
        sys.stdout.flush()
        _quiet_exit_on_signals()
        _leave_without_teardown_after_a_process_group(code)
    except BrokenPipeError:  # the reader went away (`onegpu plan --gpu list | head`): fine
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        code = 0
    sys.exit(code)


def _leave_without_teardown_after_a_process_group(code: int) -> None:
    """A process that opened a process group runs its exit handlers, flushes and leaves
    without the interpreter's teardown, where threads the group left running could abort it
    (`onegpu.distributed.context.opened_a_group`). Looked up in sys.modules: a command that
    never imported torch.distributed has nothing to do here."""
    context = sys.modules.get("onegpu.distributed.context")
    if context is None or not context.opened_a_group():
        return
    import atexit
    import logging
    import threading

    # Idle ThreadPoolExecutor workers (inductor's compile pool) wait for work until told to
    # leave, which the interpreter does before it joins threads: joined first, they never end.
    pools = sys.modules.get("concurrent.futures.thread")
    if hasattr(pools, "_python_exit"):
        pools._python_exit()
    for thread in threading.enumerate():  # as the interpreter would: its threads first
        if not thread.daemon and thread is not threading.current_thread():
            thread.join()
    atexit._run_exitfuncs()
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):
            stream.flush()
    os._exit(code)


def _quiet_exit_on_signals() -> None:
    """From here on the interpreter only finishes (threads joined, files closed): a Ctrl-C or
    SIGTERM ends it at once and quietly, as the command has said what it had to say."""

    def leave(signum: int, frame) -> None:
        os._exit(128 + signum)

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, leave)


__all__ = ["entry", "main", "make_parser"]
