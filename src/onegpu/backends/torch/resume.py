"""Continuing a run: which checkpoint, whether the run may continue from it, and restoring it.

`train.resume auto` continues the run in the run folder from its newest complete checkpoint (a
folder with none starts afresh); `train.resume PATH` from that file. Bit-exact on CPU: the
model, optimizer, scaler, data position and every RNG come back as they were. Settings that
change the trajectory (model, data, tokenizer, sequence length, batch, seed, optimizer,
precision, techniques) are refused, naming the field; `train.max_steps`, logging, evaluation,
checkpoint, output and [dist] settings may change.

The world size may change too: a sharded checkpoint (written by N processes) or a single
file resumes on any number of processes, the shards re-cut on load (Distributed Checkpoint),
the data continuing at the same global sample. Each process's RNG state comes back when the
world size is the same; otherwise the generators restart from (seed, step), which only
dropout and randomized layers draw from (a warning says so when they are on).
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import torch

from onegpu.backends.torch import checkpoint as ckpt
from onegpu.backends.torch.build import Built
from onegpu.config import Config, ConfigError, to_dict
from onegpu.distributed import DistContext, dcp, single_process

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


def find(cfg: Config, out_dir: Path, ctx: DistContext | None = None) -> ckpt.Checkpoint | None:
    """The checkpoint `train.resume` names (None: start afresh)."""
    how = cfg.train.resume
    ctx = ctx or single_process()
    if not how:
        return None
    if how == "auto":
        folder = out_dir / "checkpoints"
        if folder.is_dir() and ctx.is_main:
            ckpt.remove_partial(folder)
        ctx.barrier()
        return newest_that_loads(ckpt.complete_checkpoints(folder), ctx)
    return ckpt.load(Path(how).expanduser())


def newest_that_loads(found: list[tuple[int, Path]], ctx: DistContext) -> ckpt.Checkpoint | None:
    """The newest checkpoint that loads; a damaged newer one (a disk error, a file cut short
    by a copy) is skipped with a warning naming it and why. None: no checkpoint at all."""
    errors = []
    for _, path in reversed(found):
        try:
            previous = ckpt.load(path)
        except ConfigError as e:
            errors.append(str(e).removeprefix("train.resume: "))
            if ctx.is_main:
                warnings.warn(f"train.resume auto: skipping {path}: {errors[-1]}", stacklevel=2)
            continue
        return previous
    if errors:
        raise ConfigError(
            "train.resume",
            f"none of the {len(found)} checkpoints loads (the newest: {errors[0]}); "
            "start a new run, or give a checkpoint file that loads",
        )
    return None


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


def check_same_data(saved: str | None, built: Built) -> None:
    """ConfigError naming data.source when the run's data is not what the checkpoint trained
    on (checkpoints from before fingerprints, or without data, are not checked)."""
    if not saved or built.data is None or built.cfg.train.resume_new_data:
        return
    now = built.data.fingerprint()
    if now != saved:
        raise ConfigError(
            "data.source",
            f"the data changed since the checkpoint (it trained on {saved}; "
            f"{built.cfg.data.source} now gives {now}): resuming would continue on shifted data; "
            "restore the data, start a new run, or --train.resume_new_data true if you mean it",
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
        "data": built.data.fingerprint() if built.data is not None else None,
    }


def train_state_of(
    built: Built, *, step: int, meter: dict[str, Any], rngs: list[dict[str, Any]]
) -> dict[str, Any]:
    """A sharded checkpoint's train_state.pt: all but model and optimizer, with every
    process's RNG states (rank order)."""
    return {
        "format": ckpt.FORMAT,
        "step": step,
        "samples": step * built.cfg.train.batch_size,
        "scaler": built.step.scaler.state_dict(),
        "rng": rngs,
        "meter": meter,
        "config": to_dict(built.cfg),
        "data": built.data.fingerprint() if built.data is not None else None,
        "world_size": built.dist.world_size,
        "strategy": built.dist.strategy,
    }


def restore(built: Built, previous: ckpt.Checkpoint) -> int:
    """Model, optimizer and scaler as they were; returns the step to continue from. (RNG
    states are restored by `start_rng`, right before the first step, after anything else has
    drawn from them.)"""
    state = previous.state
    check_same_run(state["config"], built.cfg)
    check_same_data(state.get("data"), built)
    try:
        if previous.sharded:  # any world size, re-cut on load
            dcp.load(previous.path, built.model, built.optimizer)
        elif built.dist.strategy == "fsdp":  # one process's file into shards
            dcp.load_full(built.model, built.optimizer, state["model"], state["optimizer"])
        else:
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
        return
    rngs = previous.state["rng"] if previous.sharded else [previous.state["rng"]]
    ctx = built.dist
    if len(rngs) == ctx.world_size:
        ckpt.set_rng_state(rngs[ctx.rank])
        return
    torch.manual_seed(built.cfg.train.seed + previous.step)
    m = built.cfg.memory
    if built.cfg.model.dropout or m.randomized_linear:
        warnings.warn(
            f"the checkpoint was written by {len(rngs)} process(es), this run has "
            f"{ctx.world_size}: dropout and randomized layers draw new random streams from here "
            "on (the same run would draw others)",
            stacklevel=1,
        )
