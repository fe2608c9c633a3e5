"""A JAX run's checkpoints: parameters, optimizer state, the meter's counts and the data's
fingerprint in one msgpack file per step (`checkpoints/step-00000040.jax`), written under a
temporary name and renamed, so a kill leaves the previous checkpoint whole. The position in
the data is the step (the order is a function of seed and sample index, data/windows.py) and
dropout's key is folded from the step, so a resumed run continues bit for bit."""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

from flax import serialization

from onegpu.config import Config, ConfigError
from onegpu.runs.atomic import file_mode

PATTERN = re.compile(r"step-(\d{8})\.jax$")


def checkpoint_name(step: int) -> str:
    return f"step-{step:08d}.jax"


def save(folder: Path, step: int, state: dict[str, Any], keep_last: int, keep_every: int) -> Path:
    path = folder / checkpoint_name(step)
    tmp = folder / f".{path.name}.tmp{os.getpid()}"
    tmp.write_bytes(serialization.msgpack_serialize(serialization.to_state_dict(state)))
    os.chmod(tmp, file_mode())
    os.replace(tmp, path)
    _prune(folder, keep_last, keep_every)
    return path


def _prune(folder: Path, keep_last: int, keep_every: int) -> None:
    steps = sorted(s for s, _ in found(folder))
    if keep_last <= 0:
        return
    for s in steps[:-keep_last]:
        if not (keep_every and s % keep_every == 0):
            (folder / checkpoint_name(s)).unlink(missing_ok=True)


def found(folder: Path) -> list[tuple[int, Path]]:
    """(step, path) of the checkpoints in `folder`, newest first."""
    if not folder.is_dir():
        return []
    hits = [(int(m.group(1)), p) for p in folder.iterdir() if (m := PATTERN.match(p.name))]
    return sorted(hits, reverse=True)


def read(path: Path) -> dict[str, Any]:
    try:
        return serialization.msgpack_restore(path.read_bytes())
    except (OSError, ValueError, TypeError) as e:  # msgpack errors are ValueErrors
        raise ConfigError("train.resume", f"{path} does not load ({e}); give another "
                          "checkpoint or start afresh with --train.resume ''") from None  # fmt: skip


def find(cfg: Config, out_dir: Path) -> tuple[Path, dict[str, Any]] | None:
    """The checkpoint train.resume names: 'auto' the newest in the run folder that loads
    (None without one), or a path."""
    how = cfg.train.resume
    if not how:
        return None
    if how != "auto":
        path = Path(how).expanduser()
        if not path.is_file() or not PATTERN.search(path.name):
            raise ConfigError("train.resume", f"{path} is not a JAX checkpoint (step-N.jax); "
                              "use auto, or a checkpoint of a --train.backend jax run")  # fmt: skip
        return path, read(path)
    for _, path in found(out_dir / "checkpoints"):
        try:
            return path, read(path)
        except ConfigError:
            print(f"onegpu: skipped {path}: it does not load", flush=True)
    return None


def restore(template: Any, saved: Any) -> Any:
    return serialization.from_state_dict(template, saved)
