"""Sharded checkpoints of a torchrun job, written in the background where that helps.

Every process writes its shards of model and optimizer through Distributed Checkpoint into
`.tmp-step-N/`; once all of them are on disk, rank 0 adds `train_state.pt` and renames the
folder into place (checkpoint.py's all-or-nothing rule). With `checkpoint.async_save`, the
shards are copied to host memory during the call and written by a background thread while
the next steps run, as torchtitan's async checkpointing does; the rename waits for that write,
so a process killed meanwhile leaves the previous checkpoint as the newest. One save is in
flight at a time: the next one, the last one and a stop on a signal first finish it.
"""

from __future__ import annotations

import shutil
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from onegpu.build import Built
from onegpu.distributed import dcp
from onegpu.train import checkpoint as ckpt
from onegpu.train import resume
from onegpu.train.meter import Meter
from onegpu.train.run_folder import RunFolder


def async_enabled(built: Built) -> bool:
    """checkpoint.async_save resolved: 'auto' is on where the training state is on a GPU."""
    choice = built.cfg.checkpoint.async_save
    if choice == "auto":
        return built.device.type == "cuda"
    return choice == "on"


@dataclass
class _Pending:
    future: Future
    tmp: Path
    path: Path
    state: dict[str, Any] | None  # rank 0's train_state, taken when the save began


class ShardedSaver:
    def __init__(self, run: RunFolder, built: Built):
        self.run, self.built = run, built
        self.asynchronous = async_enabled(built)
        self._pending: _Pending | None = None

    def save(self, meter: Meter, *, wait: bool) -> Path:
        """Checkpoint the state after `meter.steps` steps (collective). Unless `wait`, an
        asynchronous save returns once the shards are staged; `finish` completes it."""
        self.finish()
        built, ctx = self.built, self.built.dist
        path = self.run.checkpoints / ckpt.checkpoint_name(meter.steps, sharded=True)
        tmp = path.with_name(ckpt.TMP_PREFIX + path.name)
        if ctx.is_main:
            ckpt.remove_partial(self.run.checkpoints)  # a killed save's leftovers, this one too
        ctx.barrier()
        rngs = ctx.gather(ckpt.rng_state())
        state = None
        if ctx.is_main:
            state = resume.train_state_of(built, step=meter.steps, meter=meter.state_dict(), rngs=rngs)  # fmt: skip
        if self.asynchronous:
            future = dcp.async_save(tmp, built.model, built.optimizer, group=ctx.saver)
            self._pending = _Pending(future, tmp, path, state)
            if wait:
                self.finish()
        else:
            dcp.save(tmp, built.model, built.optimizer)
            self._commit(path, state)
        return path

    def finish(self) -> None:
        """Wait for the save in flight, if any, and make it a checkpoint (collective)."""
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.future.result()  # a failed write raises here, on the process it failed on
            self._commit(pending.path, pending.state)

    def _commit(self, path: Path, state: dict[str, Any] | None) -> None:
        ctx = self.built.dist
        ctx.barrier()  # every process's shards are written
        if ctx.is_main:
            if path.exists():  # the same step saved before (a resumed run that stopped again)
                shutil.rmtree(path)
            ckpt.write_train_state_atomic(path, state)
            c = self.built.cfg.checkpoint
            ckpt.prune(self.run.checkpoints, keep_last=c.keep_last, keep_every=c.keep_every)
        ctx.barrier()
