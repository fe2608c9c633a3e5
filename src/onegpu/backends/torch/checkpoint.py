"""Crash-safe training checkpoints: everything a continuation needs, and only complete files count.

A checkpoint is one file, `DIR/checkpoints/step-00000050.pt`, holding the model, the optimizer
(every kind onegpu builds, Kahan buffers and per-parameter optimizers included), the loss
scaler, the step, the data position (samples consumed), the RNG states (torch CPU and CUDA,
Python, NumPy), the counters and the resolved config. It is written to a temporary name in the
same folder, flushed and fsynced, renamed into place and the folder fsynced (the pattern
torchtitan uses for its `.metadata`): a save killed at any moment leaves either the previous
checkpoints alone or a `.tmp-*` leftover, removed at the next start, never a half file under a
checkpoint's name. Loading uses `torch.load(weights_only=True)`: tensors and plain containers,
no pickled objects.

A run of several processes (torchrun) writes a folder instead, `DIR/checkpoints/step-00000050/`:
every process writes its shards of model and optimizer through Distributed Checkpoint into
`.tmp-step-00000050/`, rank 0 adds `train_state.pt` (everything else above, with every
process's RNG states) and renames the folder into place once all of it is on disk: the same
all-or-nothing rule, for a sharded save. Either kind resumes at any world size.
"""

from __future__ import annotations

import os
import pickle
import random
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from onegpu.config import ConfigError

FORMAT = 1
_NAME = re.compile(r"^step-(\d{8})(\.pt)?$")
TMP_PREFIX = ".tmp-"
TRAIN_STATE = "train_state.pt"
"""A sharded checkpoint's file of everything but the model and optimizer shards."""


def checkpoint_name(step: int, sharded: bool = False) -> str:
    return f"step-{step:08d}" if sharded else f"step-{step:08d}.pt"


def _is_complete(path: Path) -> bool:
    if path.is_dir():  # a sharded checkpoint only ever appears complete (renamed into place)
        return (path / TRAIN_STATE).is_file() and (path / ".metadata").is_file()
    return path.is_file() and path.suffix == ".pt"


def _remove(path: Path) -> None:
    if path.is_dir():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


def _fsync_dir(folder: Path) -> None:
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:  # not every platform opens folders
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomic(path: Path, state: dict[str, Any]) -> None:
    """torch.save to a temporary file beside `path`, fsync, rename, fsync the folder."""
    tmp = path.with_name(f"{TMP_PREFIX}{path.name}.{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as e:  # a full disk: no half-written file left to fill it further
        tmp.unlink(missing_ok=True)
        if (failed := _os_error_in(e)) is not None:  # the disk's error, whatever torch wrapped
            raise OSError(failed.errno, failed.strerror, str(path)) from None
        if isinstance(e, RuntimeError) and "write" in str(e).lower():  # torch's wrapped ENOSPC
            raise OSError(28, "no space left on device (or the write failed)", str(path)) from None
        raise
    _fsync_dir(path.parent)


def _os_error_in(e: BaseException | None) -> OSError | None:
    """The OSError behind `e`: torch.save's zip writer turns a full disk's ENOSPC into a
    RuntimeError ("unexpected pos ...") raised while handling it."""
    seen = 0
    while e is not None and seen < 8:
        if isinstance(e, OSError) and e.errno is not None:
            return e
        e, seen = e.__cause__ or e.__context__, seen + 1
    return None


def write_train_state_atomic(folder: Path, state: dict[str, Any]) -> None:
    """A sharded checkpoint's last piece: train_state.pt into the (temporary) folder, then the
    folder renamed to `folder`'s name and the parent fsynced."""
    tmp_folder = folder.with_name(TMP_PREFIX + folder.name)
    write_atomic(tmp_folder / TRAIN_STATE, state)
    os.replace(tmp_folder, folder)
    _fsync_dir(folder.parent)


def remove_partial(folder: Path) -> list[Path]:
    """Delete leftovers of saves that were killed (files and sharded folders); returns them."""
    removed = list(folder.glob(f"{TMP_PREFIX}*"))
    for p in removed:
        _remove(p)
    return removed


def complete_checkpoints(folder: Path) -> list[tuple[int, Path]]:
    """(step, path) of every complete checkpoint in `folder`, oldest first."""
    if not folder.is_dir():
        return []
    found = [
        (int(m.group(1)), p)
        for p in folder.iterdir()
        if (m := _NAME.match(p.name)) and _is_complete(p)
    ]
    return sorted(found)


def prune(
    folder: Path, *, keep_last: int, keep_every: int, keep_before: int | None = None
) -> Path | None:
    """Keep the newest `keep_last` checkpoints, every multiple of `keep_every` steps, and the
    newest at or before step `keep_before` (the last good one, while updates are being
    skipped: it outlives a divergence whatever keep_last says); returns that one."""
    ckpts = complete_checkpoints(folder)
    newest = {step for step, _ in ckpts[-keep_last:]} if keep_last > 0 else set()
    good = [(step, path) for step, path in ckpts if keep_before is not None and step <= keep_before]
    last_good = good[-1] if good else None
    for step, path in ckpts:
        if step in newest or (keep_every and step % keep_every == 0) or (step, path) == last_good:
            continue
        _remove(path)
    return last_good[1] if last_good else None


# ---------------------------------------------------------------------------- RNG states


def rng_state() -> dict[str, Any]:
    """Every generator a step may draw from: dropout and randomized linear (torch), stochastic
    rounding (torch, on the device), and Python's and NumPy's for user code."""
    np_state = np.random.get_state(legacy=False)
    return {
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
        "python": random.getstate(),
        "numpy": {
            "key": torch.from_numpy(np_state["state"]["key"].astype(np.int64)),
            "pos": int(np_state["state"]["pos"]),
            "has_gauss": int(np_state["has_gauss"]),
            "gauss": float(np_state["gauss"]),
        },
    }


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    if state["cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    random.setstate(_as_tuples(state["python"]))
    n = state["numpy"]
    np.random.set_state(
        {
            "bit_generator": "MT19937",
            "state": {"key": n["key"].numpy().astype(np.uint32), "pos": n["pos"]},
            "has_gauss": n["has_gauss"],
            "gauss": n["gauss"],
        }
    )


def _as_tuples(x: Any) -> Any:
    return tuple(_as_tuples(v) for v in x) if isinstance(x, (list, tuple)) else x


# ---------------------------------------------------------------------------- loading


@dataclass(frozen=True, slots=True)
class Checkpoint:
    path: Path
    state: dict[str, Any]

    @property
    def step(self) -> int:
        return int(self.state["step"])

    @property
    def sharded(self) -> bool:
        """A folder written by several processes: model and optimizer are in DCP shards."""
        return self.path.is_dir()


def _allow_optimizer_tensor_types() -> bool:
    """torchao's 8-bit optimizer states are tensor subclasses: allow exactly those classes."""
    try:
        from torchao.optim.subclass_8bit import OptimState8bit
    except ImportError:
        return False
    torch.serialization.add_safe_globals([OptimState8bit])
    return True


def _torch_load(path: Path) -> Any:
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        # 8-bit AdamW states: allow their class (importing torchao only when one is there)
        if "OptimState8bit" in str(e) and _allow_optimizer_tensor_types():
            return torch.load(path, map_location="cpu", weights_only=True)
        raise


def load(path: Path, field: str = "train.resume") -> Checkpoint:
    """A checkpoint (file or sharded folder), or ConfigError naming `field` if it is missing,
    truncated or foreign."""
    if path.is_dir():
        if not _is_complete(path):
            raise ConfigError(
                field,
                f"{path} is not a complete sharded checkpoint (no {TRAIN_STATE} or .metadata); "
                "resume from another one or auto",
            )
        return Checkpoint(path, _load_state(path / TRAIN_STATE, field, sharded=True))
    if not path.is_file():
        raise ConfigError(
            field, f"{path} is not a checkpoint; give a step-* file or folder, or auto"
        )
    return Checkpoint(path, _load_state(path, field, sharded=False))


def _load_state(path: Path, field: str, *, sharded: bool) -> dict[str, Any]:
    try:
        state = _torch_load(path)
    except pickle.UnpicklingError:
        raise ConfigError(
            field,
            f"{path} is not a checkpoint of tensors: it is corrupt, or holds pickled Python "
            "objects (unsafe to load); resume from an onegpu checkpoint or start afresh",
        ) from None
    except Exception as e:  # a truncated zip, not a torch file at all
        raise ConfigError(
            field,
            f"{path} cannot be read as a checkpoint: it is corrupt, truncated or not a "
            f"checkpoint file ({type(e).__name__}); resume from an older one or start afresh",
        ) from None
    holds = "world_size" if sharded else "model"
    if not isinstance(state, dict) or state.get("format") != FORMAT or holds not in state:
        raise ConfigError(
            field, f"{path} is not an onegpu training checkpoint (format {FORMAT} expected)"
        )
    return state
