"""The torch state of a run as checkpoint bytes, and back (runs/checkpoints.py holds the rules
every backend's checkpoints follow: names, atomic writes, pruning, the same-run checks).

A single-process checkpoint is one `torch.save` file holding the shared part, the model, the
optimizer (every kind onegpu builds, Kahan buffers and per-parameter optimizers included), the
loss scaler and the RNG states (torch CPU and CUDA, Python, NumPy). A torchrun job writes a
folder: every process's shards of model and optimizer through Distributed Checkpoint, and
`train_state.pt` with everything else (every process's RNG states). Loading uses
`torch.load(weights_only=True)`: tensors and plain containers, no pickled objects. Either kind
resumes at any world size: the shards are re-cut on load; each process's RNG state comes back
when the world size is the same, otherwise the generators restart from (seed, step), which only
dropout and randomized layers draw from (a warning says so when they are on).
"""

from __future__ import annotations

import pickle
import random
import warnings
from pathlib import Path
from typing import IO, Any

import numpy as np
import torch
from torch.utils._pytree import tree_map_only

from onegpu.backends.torch.build import Built
from onegpu.config import ConfigError
from onegpu.distributed import compression, dcp
from onegpu.offload.host_optimizer import HostOffloadOptimizer
from onegpu.offload.host_states import copy_to
from onegpu.optim.in_backward import PerParameterOptimizers
from onegpu.runs import checkpoints
from onegpu.runs.checkpoints import FOLDER_STATE, Checkpoint

SUFFIX = ".pt"
TRAIN_STATE = FOLDER_STATE


def checkpoint_name(step: int, sharded: bool = False) -> str:
    """A torch checkpoint's name: a file, or a folder of shards."""
    return checkpoints.checkpoint_name(step, "" if sharded else SUFFIX)


def save_file(path: Path, state: dict[str, Any]) -> None:
    """`state` as one crash-safe torch.save file."""
    checkpoints.write_atomic(path, lambda f: _save(state, f))


def _save(state: dict[str, Any], f: IO[bytes]) -> None:
    torch.save(state, f)


def read(path: Path, field: str = "train.resume") -> dict[str, Any]:
    """A checkpoint file's state, or a folder's train_state (ConfigError naming `field` when
    it is corrupt, truncated or holds pickled objects)."""
    return _load_state(path / TRAIN_STATE if path.is_dir() else path, field)


def load(path: Path, field: str = "train.resume") -> Checkpoint:
    """A torch checkpoint (file or folder), checked as runs/checkpoints.py checks any."""
    return checkpoints.load(path, "torch", lambda p: read(p, field), field)


def state_of(built: Built, common: dict[str, Any]) -> dict[str, Any]:
    """A single file's state: the shared part, model, optimizer, scaler and RNG states."""
    return {
        **common,
        "model": model_state(built),
        "optimizer": built.optimizer.state_dict(),
        "scaler": built.step.scaler.state_dict(),
        "rng": rng_state(),
    }


def model_state(built: Built) -> dict[str, torch.Tensor]:
    """The model's weights at full precision: the host optimizer's fp32 masters where the
    device holds bf16 copies (offload/host_optimizer.py)."""
    if isinstance(built.optimizer, HostOffloadOptimizer):
        return built.optimizer.full_precision_state(built.model)
    return built.model.state_dict()


def train_state_of(
    built: Built, common: dict[str, Any], rngs: list[dict[str, Any]], comms: list[Any]
) -> dict[str, Any]:
    """A sharded checkpoint's train_state.pt: all but model and optimizer, with every
    process's RNG states and gradient compression state (rank order)."""
    return {
        **common,
        "scaler": built.step.scaler.state_dict(),
        "rng": rngs,
        "grad_compression": comms,
        "world_size": built.dist.world_size,
        "strategy": built.dist.strategy,
        "layout": built.dist.layout.sizes(),
    }


def load_state(built: Built, previous: Checkpoint) -> None:
    """Model, optimizer and scaler as they were. (RNG states are restored by `start_rng`,
    right before the first step, after anything else has drawn from them.)"""
    state = previous.state
    try:
        if previous.sharded:  # any world size, re-cut on load
            dcp.load(previous.path, built.model, built.optimizer)
        elif built.dist.strategy == "fsdp" or built.dist.layout.splits_model:  # into shards
            dcp.load_full(built.model, built.optimizer, state["model"], state["optimizer"])
        else:
            source = _weights_and_states(built, previous)
            built.model.load_state_dict(source["model"])
            built.optimizer.load_state_dict(source["optimizer"])
            if isinstance(built.optimizer, HostOffloadOptimizer):  # fp32 masters as saved
                built.optimizer.take_weights(built.model, source["model"])
            del source
    except (RuntimeError, ValueError, KeyError) as e:
        raise ConfigError(
            "train.resume", f"{previous.path} does not fit this model or optimizer ({e})"
        ) from None
    # restored: the run holds its own copies now, not a second one for its whole length;
    # the small rest (RNG, meter) is copied out, so nothing keeps the file mapped
    state.pop("model", None)
    state.pop("optimizer", None)
    state.update(tree_map_only(torch.Tensor, torch.clone, state))
    if state["scaler"]:
        built.step.scaler.load_state_dict(state["scaler"])
    comms = state.get("grad_compression") or []
    if built.comm_state is not None and len(comms) == built.dist.world_size:
        compression.load_state_dict(built.comm_state, comms[built.dist.rank], built.device)


def _weights_and_states(built: Built, previous: Checkpoint) -> dict[str, Any]:
    """Where a single-file checkpoint's model and optimizer state are restored from.

    On a GPU from the file's mapping: each tensor is copied straight to where it lives (the
    device; host memory for memory.offload_states, a parameter at a time), so the host never
    holds the checkpoint (an 8B model's is 30 GB), only page cache the kernel can reclaim. On
    a CPU read into memory: torch's optimizers adopt a state tensor already on the right
    device (no copy), and the model's copy is freed once restored, so a resume holds no more
    than a fresh run, and no mapped file pages count in its resident set."""
    parks = isinstance(built.optimizer, PerParameterOptimizers) and built.optimizer.states
    if built.device.type == "cpu" and not parks:
        return _torch_load(previous.path, mmap=False)
    state = previous.state
    optimizer = built.optimizer
    # a host optimizer adopts its states as given (the disk tier copies them into its files);
    # any optimizer keeps its step count as given, a 0-dim slice that would keep the whole
    # mapping alive: those are copied out of the file
    adopts = isinstance(optimizer, HostOffloadOptimizer) and optimizer.disk is None
    state["optimizer"] = tree_map_only(
        torch.Tensor,
        lambda t: copy_to(t, t.device) if adopts or t.dim() == 0 else t,
        state["optimizer"],
    )
    return state


def start_rng(built: Built, previous: Checkpoint | None) -> None:
    """The generators the steps draw from: seeded afresh, or as the checkpoint saved them;
    each tensor-parallel rank and pipeline stage on a stream of its own."""
    ctx = built.dist
    stream = ctx.random_stream << 32  # stream 0 (every layout without tp or pp): the seed
    if previous is None:
        torch.manual_seed(built.cfg.train.seed + stream)
        return
    rngs = previous.state["rng"] if previous.sharded else [previous.state["rng"]]
    if len(rngs) == ctx.world_size:
        set_rng_state(rngs[ctx.rank])
        return
    torch.manual_seed(built.cfg.train.seed + previous.step + stream)
    m = built.cfg.memory
    if built.cfg.model.dropout or m.randomized_linear:
        warnings.warn(
            f"the checkpoint was written by {len(rngs)} process(es), this run has "
            f"{ctx.world_size}: dropout and randomized layers draw new random streams from here "
            "on (the same run would draw others)",
            stacklevel=1,
        )


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


def _allow_optimizer_tensor_types() -> bool:
    """torchao's 8-bit optimizer states are tensor subclasses: allow exactly those classes."""
    try:
        from torchao.optim.subclass_8bit import OptimState8bit
    except ImportError:
        return False
    torch.serialization.add_safe_globals([OptimState8bit])
    return True


def _torch_load(path: Path, *, mmap: bool = True) -> Any:
    """The file's state; with `mmap` its tensors mapped from the file, not read (reading the
    step, config and RNG states touches none of the weights' pages)."""
    try:
        return torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    except pickle.UnpicklingError as e:
        # 8-bit AdamW states: allow their class (importing torchao only when one is there)
        if "OptimState8bit" in str(e) and _allow_optimizer_tensor_types():
            return torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
        raise


def _load_state(path: Path, field: str) -> dict[str, Any]:
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
    return state
