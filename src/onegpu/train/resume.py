"""Continuing a run: which checkpoint, whether the run may continue from it, and restoring it.

`train.resume auto` continues the run in the run folder from its newest complete checkpoint (a
folder with none starts afresh); `train.resume PATH` from that file. Bit-exact on CPU: the
model, optimizer, scaler, data position and every RNG come back as they were. Settings that
change the trajectory (model, data, tokenizer, sequence length, batch, seed, optimizer,
precision, techniques) are refused, naming the field; `train.max_steps`, logging, evaluation,
checkpoint and output settings may change.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from onegpu.build import Built
from onegpu.config import Config, ConfigError, to_dict
from onegpu.train import checkpoint as ckpt

# Fields a resumed run may change: they do not alter what the next step computes.
MAY_CHANGE = {
    "train.max_steps",
    "train.log_every",
    "train.eval_every",
    "train.eval_batches",
    "train.measure_memory",
    "train.resume",
    "train.device",
    "data.num_workers",
    "data.cache_dir",
}
MAY_CHANGE_SECTIONS = {"out", "checkpoint"}


def find(cfg: Config, out_dir: Path) -> ckpt.Checkpoint | None:
    """The checkpoint `train.resume` names (None: start afresh)."""
    how = cfg.train.resume
    if not how:
        return None
    if how == "auto":
        folder = out_dir / "checkpoints"
        if folder.is_dir():
            ckpt.remove_partial(folder)
        found = ckpt.complete_checkpoints(folder)
        return ckpt.load(found[-1][1]) if found else None
    return ckpt.load(Path(how).expanduser())


def check_same_run(saved: dict[str, Any], cfg: Config) -> None:
    """ConfigError naming the first setting that differs from the checkpoint's and would change
    the trajectory."""
    now = to_dict(cfg)
    for section, fields in saved.items():
        if section in MAY_CHANGE_SECTIONS or section not in now:
            continue
        for name, old in fields.items():
            key = f"{section}.{name}"
            new = now[section].get(name)
            if key in MAY_CHANGE or new == old:
                continue
            raise ConfigError(
                key,
                f"the checkpoint was trained with {old!r}, this run asks for {new!r}; "
                f"resuming would not continue the same run: set --{key} {old} or start "
                "a new run (another --out, or --train.resume '')",
            )


def state_of(built: Built, *, step: int, meter: dict[str, Any]) -> dict[str, Any]:
    """Everything a continuation needs, as tensors and plain containers."""
    return {
        "format": ckpt.FORMAT,
        "step": step,
        "samples": step * built.cfg.train.batch_size,
        "model": built.model.state_dict(),
        "optimizer": built.optimizer.state_dict(),
        "scaler": built.step.scaler.state_dict(),
        "rng": ckpt.rng_state(),
        "meter": meter,
        "config": to_dict(built.cfg),
    }


def restore(built: Built, previous: ckpt.Checkpoint) -> int:
    """Model, optimizer and scaler as they were; returns the step to continue from. (RNG
    states are restored by `start_rng`, right before the first step, after anything else has
    drawn from them.)"""
    state = previous.state
    check_same_run(state["config"], built.cfg)
    try:
        built.model.load_state_dict(state["model"])
        built.optimizer.load_state_dict(state["optimizer"])
    except (RuntimeError, ValueError, KeyError) as e:
        raise ConfigError(
            "train.resume", f"{previous.path} does not fit this model or optimizer ({e})"
        ) from None
    if state["scaler"]:
        built.step.scaler.load_state_dict(state["scaler"])
    return previous.step


def start_rng(built: Built, previous: ckpt.Checkpoint | None) -> None:
    """The generators the steps draw from: seeded afresh, or as the checkpoint saved them."""
    if previous is None:
        torch.manual_seed(built.cfg.train.seed)
    else:
        ckpt.set_rng_state(previous.state["rng"])
