"""Crash-safe checkpoints, whichever framework wrote them: names, finding the newest one that
loads, pruning, the atomic write, and the checks that a resume continues the same run on the
same data. A backend supplies only how its state becomes bytes (`Backend.write_checkpoint`,
`Backend.read_checkpoint`); everything here is written once, for both.

A checkpoint is `DIR/checkpoints/step-00000050.pt` (torch), `step-00000050.jax` (JAX) or the
folder `step-00000050/` (torch shards of a torchrun job, with `train_state.pt` written last).
It is written under a `.tmp-` name in the same folder, flushed and fsynced, renamed into place
and the folder fsynced (the pattern torchtitan uses for its `.metadata`): a save killed at any
moment leaves either the previous checkpoints alone or a `.tmp-*` leftover, removed at the next
start, never a half file under a checkpoint's name.

Every checkpoint holds the same shared part (`common_state`): the format, the backend that
wrote it, the step, the samples consumed, the meter, the resolved config and the data's
fingerprint. A run never resumes from, writes into, prunes or replaces what another backend
wrote: `refuse_other_backend` says so in one line, with the way across (`model.init_from`).
"""

from __future__ import annotations

import copy
import os
import re
import shutil
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from onegpu.config import Config, ConfigError, apply_values, to_dict, validate

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

FORMAT = 1
TMP_PREFIX = ".tmp-"
FOLDER_STATE = "train_state.pt"
"""A folder checkpoint's file of everything but the shards, written last (its commit mark)."""
SUFFIX_OF = {"torch": ".pt", "jax": ".jax"}
"""Each backend's single-file suffix; a folder of shards is torch's (DCP)."""
_NAME = re.compile(r"^step-(\d{8})(\.[a-z]+)?$")

# Fields a resumed run may change: they do not alter what the next step computes.
MAY_CHANGE = {
    "train.max_steps",
    "train.log_every",
    "train.eval_every",
    "train.eval_batches",
    "train.measure_memory",
    "train.resume",
    "train.resume_new_data",
    "train.skip_memory_check",
    "train.device",
    "data.num_workers",
    "data.cache_dir",
    "memory.offload_optimizer",  # where the states live, not what they are
    "memory.offload_params",
}
MAY_CHANGE_SECTIONS = {"out", "checkpoint", "dist"}


@dataclass(frozen=True, slots=True)
class Checkpoint:
    """A checkpoint as read: where it is and its state (for a folder: its train_state)."""

    path: Path
    state: dict[str, Any]

    @property
    def step(self) -> int:
        return int(self.state["step"])

    @property
    def sharded(self) -> bool:
        """A folder written by several processes: model and optimizer are in shards."""
        return self.path.is_dir()


def checkpoint_name(step: int, suffix: str) -> str:
    """`step-00000050` + the backend's suffix ('' for a folder of shards)."""
    return f"step-{step:08d}{suffix}"


def written_by(path: Path) -> str | None:
    """The backend a checkpoint's name says wrote it (None: not a checkpoint name)."""
    m = _NAME.match(path.name)
    if m is None:
        return None
    suffix = m.group(2) or ""
    if not suffix:
        return "torch"
    return next((name for name, s in SUFFIX_OF.items() if s == suffix), None)


def _is_complete(path: Path) -> bool:
    if path.is_dir():  # a folder only ever appears complete (renamed into place)
        return (path / FOLDER_STATE).is_file()
    return path.is_file() and written_by(path) is not None


def complete_checkpoints(folder: Path, backend: str | None = None) -> list[tuple[int, Path]]:
    """(step, path) of every complete checkpoint in `folder` (of `backend` only, if given),
    oldest first."""
    if not folder.is_dir():
        return []
    found = [
        (int(m.group(1)), p)
        for p in folder.iterdir()
        if (m := _NAME.match(p.name)) and _is_complete(p)
        if backend is None or written_by(p) == backend
    ]
    return sorted(found)


def run_backend(run_dir: Path) -> str | None:
    """The backend of the run in `run_dir`: its config.toml's train.backend, else the
    checkpoints' names (None: no run there)."""
    try:
        with open(run_dir / "config.toml", "rb") as f:
            return tomllib.load(f).get("train", {}).get("backend", "torch")
    except (OSError, tomllib.TOMLDecodeError):
        pass
    names = {written_by(p) for _, p in complete_checkpoints(run_dir / "checkpoints")}
    return next(iter(sorted(n for n in names if n)), None)


def refuse_other_backend(run_dir: Path, backend: str, *, field: str = "train.resume") -> None:
    """ConfigError when `run_dir` holds a run another backend wrote: resuming it would start
    afresh and replace that run's weights and checkpoints."""
    other = run_backend(run_dir)
    if other is None or other == backend:
        return
    raise ConfigError(
        field,
        f"{run_dir} holds a {other} run (train.backend {other}); a {backend} run cannot "
        f"continue it: resume with --train.backend {other}, or start a new {backend} run from "
        f"its weights with --model.init_from {run_dir / 'model.safetensors'} and another --out",
    )


def remove_partial(folder: Path) -> list[Path]:
    """Delete leftovers of saves that were killed (files and folders); returns them."""
    removed = list(folder.glob(f"{TMP_PREFIX}*"))
    for p in removed:
        _remove(p)
    return removed


def _remove(path: Path) -> None:
    if path.is_dir():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


def fsync_dir(folder: Path) -> None:
    """Make a rename in `folder` durable (where the platform opens folders)."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomic(path: Path, write: Callable[[IO[bytes]], None]) -> None:
    """`write(file)` into a temporary file beside `path`, fsync, rename, fsync the folder. A
    failed write (a full disk) leaves no half file behind and raises the disk's OSError."""
    tmp = path.with_name(f"{TMP_PREFIX}{path.name}.{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as e:
        tmp.unlink(missing_ok=True)
        if (failed := _os_error_in(e)) is not None:  # the disk's error, whatever wrapped it
            raise OSError(failed.errno, failed.strerror, str(path)) from None
        if isinstance(e, RuntimeError) and "write" in str(e).lower():  # torch's wrapped ENOSPC
            raise OSError(28, "no space left on device (or the write failed)", str(path)) from None
        raise
    fsync_dir(path.parent)


def _os_error_in(e: BaseException | None) -> OSError | None:
    """The OSError behind `e`: torch.save's zip writer turns a full disk's ENOSPC into a
    RuntimeError ("unexpected pos ...") raised while handling it."""
    seen = 0
    while e is not None and seen < 8:
        if isinstance(e, OSError) and e.errno is not None:
            return e
        e, seen = e.__cause__ or e.__context__, seen + 1
    return None


def commit_folder(folder: Path, state_writer: Callable[[IO[bytes]], None]) -> None:
    """A folder checkpoint's last piece: its state file into the `.tmp-` folder the shards
    were written to, then the folder renamed to `folder`'s name and the parent fsynced."""
    tmp_folder = folder.with_name(TMP_PREFIX + folder.name)
    write_atomic(tmp_folder / FOLDER_STATE, state_writer)
    if folder.exists():  # the same step saved before (a resumed run that stopped again)
        shutil.rmtree(folder)
    os.replace(tmp_folder, folder)
    fsync_dir(folder.parent)


def prune(
    folder: Path, *, keep_last: int, keep_every: int, keep_before: int | None = None
) -> Path | None:
    """Keep the newest `keep_last` checkpoints, every multiple of `keep_every` steps, and the
    newest at or before step `keep_before` (the last good one, while updates are being
    skipped: it outlives a divergence whatever keep_last says); returns that one. Only this
    run's own checkpoints are in `folder` (another backend's run is refused before)."""
    ckpts = complete_checkpoints(folder)
    newest = {step for step, _ in ckpts[-keep_last:]} if keep_last > 0 else set()
    good = [(step, path) for step, path in ckpts if keep_before is not None and step <= keep_before]
    last_good = good[-1] if good else None
    for step, path in ckpts:
        if step in newest or (keep_every and step % keep_every == 0) or (step, path) == last_good:
            continue
        _remove(path)
    return last_good[1] if last_good else None


def common_state(cfg: Config, *, backend: str, step: int, meter: dict, data: str | None) -> dict:
    """What every checkpoint holds besides the framework's state."""
    return {
        "format": FORMAT,
        "backend": backend,
        "step": step,
        "samples": step * cfg.train.batch_size,
        "meter": meter,
        "config": to_dict(cfg),
        "data": data,
    }


def find(
    cfg: Config,
    out_dir: Path,
    *,
    backend: str,
    read: Callable[[Path], dict[str, Any]],
    warn: Callable[[str], None],
) -> Checkpoint | None:
    """The checkpoint `train.resume` names (None: start afresh): 'auto' the newest in the run
    folder that loads (a damaged newer one skipped with a warning), or a path; only this
    backend's checkpoints are looked at, and one of another backend given as a path is
    refused."""
    how = cfg.train.resume
    if not how:
        return None
    if how == "auto":  # another backend's run: refused before (lifecycle._prepare_resume)
        found = complete_checkpoints(out_dir / "checkpoints", backend)
        return newest_that_loads(found, lambda p: load(p, backend, read), warn)
    return load(Path(how).expanduser(), backend, read)


def newest_that_loads(
    found: list[tuple[int, Path]],
    load_one: Callable[[Path], Checkpoint],
    warn: Callable[[str], None],
) -> Checkpoint | None:
    """The newest checkpoint that loads; a damaged newer one (a disk error, a file cut short
    by a copy) is skipped with a warning naming it and why. None: no checkpoint at all."""
    errors = []
    for _, path in reversed(found):
        try:
            return load_one(path)
        except ConfigError as e:
            errors.append(str(e).removeprefix("train.resume: "))
            warn(f"train.resume auto: skipping {path}: {errors[-1]}")
    if errors:
        raise ConfigError(
            "train.resume",
            f"none of the {len(found)} checkpoints loads (the newest: {errors[0]}); "
            "start a new run, or give a checkpoint file that loads",
        )
    return None


def load(
    path: Path, backend: str, read: Callable[[Path], dict[str, Any]], field: str = "train.resume"
) -> Checkpoint:
    """A checkpoint of `backend` (file or folder), or ConfigError naming `field` if it is
    missing, truncated, foreign or another backend's."""
    if not path.exists():
        raise ConfigError(
            field, f"{path} is not a checkpoint; give a step-* file or folder, or auto"
        )
    other = written_by(path)
    if other is not None and other != backend:
        raise ConfigError(
            field,
            f"{path} is a {other} checkpoint; resume it with --train.backend {other}, or start "
            f"a {backend} run from that run's weights with --model.init_from RUN/model.safetensors",
        )
    if path.is_dir() and not _is_complete(path):
        raise ConfigError(
            field,
            f"{path} is not a complete sharded checkpoint (no {FOLDER_STATE}); "
            "resume from another one or auto",
        )
    state = read(path)
    if not isinstance(state, dict) or state.get("format") != FORMAT or "step" not in state:
        raise ConfigError(
            field, f"{path} is not an onegpu training checkpoint (format {FORMAT} expected)"
        )
    if state.get("backend", backend) != backend:
        raise ConfigError(field, f"{path} was written by the {state['backend']} backend")
    return Checkpoint(path, state)


def keep_decisions(saved: dict[str, Any] | None, cfg: Config) -> Config:
    """`cfg` with every field it leaves `auto` (or to a budget) set to what the checkpoint's
    run decided for it: a resumed `auto` continues the run as it was, whatever this run would
    decide afresh (a shorter `train.max_steps` must not turn `train.compile auto` from compiled
    to eager and so refuse the resume). `cfg` itself is untouched."""
    now = to_dict(cfg)
    decided: dict[str, Any] = {}
    for section, fields in (saved or {}).items():
        if section in MAY_CHANGE_SECTIONS or section not in now:
            continue
        for name, old in fields.items():
            key = f"{section}.{name}"
            value = now[section].get(name)
            undecided = value == "auto" or (
                key == "memory.checkpointing" and str(value).startswith("budget:")
            )
            if key not in MAY_CHANGE and undecided and old != "auto":
                decided[key] = old
    if not decided:
        return cfg
    kept = apply_values(copy.deepcopy(cfg), decided, origin="the checkpoint's config")
    validate(kept)
    return kept


def check_same_run(saved: dict[str, Any] | None, cfg: Config) -> None:
    """ConfigError naming the first setting that differs from the checkpoint's and would change
    the trajectory (a checkpoint without its config is not checked)."""
    now = to_dict(cfg)
    for section, fields in (saved or {}).items():
        if section in MAY_CHANGE_SECTIONS or section not in now:
            continue
        for name, old in fields.items():
            key = f"{section}.{name}"
            new = now[section].get(name)
            if key in MAY_CHANGE or new == old or old == "auto":  # "auto": not recorded then
                continue
            raise ConfigError(
                key,
                f"the checkpoint was trained with {old!r}, this run asks for {new!r}; "
                f"resuming would not continue the same run: set --{key} {old} or start "
                "a new run (another --out, or --train.resume '')",
            )


def check_same_data(saved: str | None, now: str | None, cfg: Config) -> None:
    """ConfigError naming data.source when the run's data is not what the checkpoint trained
    on (checkpoints without a fingerprint, or runs without data, are not checked)."""
    if not saved or now is None or cfg.train.resume_new_data or now == saved:
        return
    raise ConfigError(
        "data.source",
        f"the data changed since the checkpoint (it trained on {saved}; "
        f"{cfg.data.source} now gives {now}): resuming would continue on shifted data; "
        "restore the data, start a new run, or --train.resume_new_data true if you mean it",
    )
