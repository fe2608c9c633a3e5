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
"""

from __future__ import annotations

import os
import pickle
import random
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from onegpu.config import ConfigError

FORMAT = 1
_NAME = re.compile(r"^step-(\d{8})\.pt$")
TMP_PREFIX = ".tmp-"


def checkpoint_name(step: int) -> str:
    return f"step-{step:08d}.pt"


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
    with open(tmp, "wb") as f:
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(path.parent)


def remove_partial(folder: Path) -> list[Path]:
    """Delete leftovers of saves that were killed; returns what was removed."""
    removed = [p for p in folder.glob(f"{TMP_PREFIX}*") if p.is_file()]
    for p in removed:
        p.unlink(missing_ok=True)
    return removed


def complete_checkpoints(folder: Path) -> list[tuple[int, Path]]:
    """(step, path) of every complete checkpoint in `folder`, oldest first."""
    if not folder.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in folder.iterdir() if (m := _NAME.match(p.name))]
    return sorted(found)


def prune(folder: Path, *, keep_last: int, keep_every: int) -> None:
    """Keep the newest `keep_last` checkpoints and every multiple of `keep_every` steps."""
    ckpts = complete_checkpoints(folder)
    newest = {step for step, _ in ckpts[-keep_last:]} if keep_last > 0 else set()
    for step, path in ckpts:
        if step in newest or (keep_every and step % keep_every == 0):
            continue
        path.unlink(missing_ok=True)


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
    """A checkpoint file, or ConfigError naming `field` if it is missing, truncated or foreign."""
    if not path.is_file():
        raise ConfigError(field, f"{path} is not a checkpoint file; give a step-*.pt file or auto")
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
    if not isinstance(state, dict) or state.get("format") != FORMAT or "model" not in state:
        raise ConfigError(
            field, f"{path} is not an onegpu training checkpoint (format {FORMAT} expected)"
        )
    return Checkpoint(path, state)
