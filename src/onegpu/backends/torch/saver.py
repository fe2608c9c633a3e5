"""The one checkpoint saver of a run, chosen once (`make_saver`): single files, or the sharded
checkpoints of a torchrun job (written in the background where that helps). Both write the
final weights as model.safetensors and never save non-finite weights.

A single-process run writes `step-N.pt` files (checkpoint.py's crash-safe rule). Under torchrun
every process writes its shards of model and optimizer through Distributed Checkpoint into
`.tmp-step-N/`; once all of them are on disk, rank 0 adds `train_state.pt` and renames the
folder into place (checkpoint.py's all-or-nothing rule). With `checkpoint.async_save`, the
shards are copied to host memory during the call and written by a background thread while
the next steps run, as torchtitan's async checkpointing does; the rename waits for that write,
so a process killed meanwhile leaves the previous checkpoint as the newest. One save is in
flight at a time: the next one, the last one and a stop on a signal first finish it.
"""

from __future__ import annotations

import os
import shutil
import warnings
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch

from onegpu.backends.torch import checkpoint as ckpt
from onegpu.backends.torch import resume
from onegpu.backends.torch.build import Built, make_model
from onegpu.distributed import dcp
from onegpu.distributed.parallelize import local_tensor
from onegpu.runs.atomic import file_mode
from onegpu.runs.folder import RunFolder
from onegpu.runs.meter import Meter


class Saver(Protocol):
    def save(self, meter: Meter, *, wait: bool) -> Path | None:
        """Checkpoint the state after `meter.steps` steps (None: weights not finite, not
        saved). Unless `wait`, a sharded save may finish in the background."""

    def final_weights(self) -> None:
        """model.safetensors: the trained weights alone, written atomically by rank 0."""

    def finish(self) -> None:
        """Wait for a save still in flight, if any."""

    last_good: Path | None
    """The newest checkpoint from before the updates being skipped now (kept whatever
    checkpoint.keep_last says), as of the last save."""


def make_saver(run: RunFolder, built: Built) -> Saver:
    """Sharded (DCP) checkpoints under torchrun, single files otherwise."""
    return ShardedSaver(run, built) if built.dist.enabled else FileSaver(run, built)


def weights_finite(built: Built) -> bool:
    """Checked before anything is saved (one host read per save, not per step); over every
    process's shards under torchrun."""
    params = [local_tensor(p.detach()) for p in built.model.parameters()]
    finite = bool(torch.stack([torch.isfinite(p).all() for p in params]).all())
    return not built.dist.any_true(not finite)


def _refuse_non_finite(built: Built, what: str) -> bool:
    """True (after a warning from rank 0) when the weights are not finite."""
    if weights_finite(built):
        return False
    if built.dist.is_main:
        warnings.warn(f"{what}: non-finite weights, not written", stacklevel=2)
    return True


def write_safetensors(model: torch.nn.Module, path: Path) -> None:
    """`model`'s weights as safetensors at `path`, atomically (temporary name, rename)."""
    from safetensors.torch import save_model

    tmp = path.with_name(f"{ckpt.TMP_PREFIX}{path.name}.{os.getpid()}")
    save_model(model, str(tmp), metadata={"format": "pt"})
    os.chmod(tmp, file_mode())  # safetensors creates 0600; the run's other files are 0644
    os.replace(tmp, path)


class FileSaver:
    """One process: every checkpoint one crash-safe file, then pruned."""

    def __init__(self, run: RunFolder, built: Built):
        self.run, self.built = run, built
        self.last_good: Path | None = None

    def save(self, meter: Meter, *, wait: bool = True) -> Path | None:
        if _refuse_non_finite(self.built, f"step {meter.steps}: checkpoint"):
            return None
        state = resume.state_of(self.built, step=meter.steps, meter=meter.state_dict())
        path = self.run.checkpoints / ckpt.checkpoint_name(meter.steps)
        ckpt.write_atomic(path, state)
        c = self.built.cfg.checkpoint
        self.last_good = ckpt.prune(self.run.checkpoints, keep_last=c.keep_last,
                                    keep_every=c.keep_every, keep_before=meter.good_until())  # fmt: skip
        return path

    def final_weights(self) -> None:
        if not _refuse_non_finite(self.built, "model.safetensors"):
            write_safetensors(self.built.model, self.run.path / "model.safetensors")

    def finish(self) -> None:
        pass


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
    good_until: int  # the last step before the skipped updates in a row, if any


class ShardedSaver:
    """Several processes: DCP shards per process, committed by rank 0."""

    def __init__(self, run: RunFolder, built: Built):
        self.run, self.built = run, built
        self.asynchronous = async_enabled(built)
        self._pending: _Pending | None = None
        self.last_good: Path | None = None

    def save(self, meter: Meter, *, wait: bool) -> Path | None:
        """Checkpoint the state after `meter.steps` steps (collective). Unless `wait`, an
        asynchronous save returns once the shards are staged; `finish` completes it."""
        if _refuse_non_finite(self.built, f"step {meter.steps}: checkpoint"):
            return None
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
            self._pending = _Pending(future, tmp, path, state, meter.good_until())
            if wait:
                self.finish()
        else:
            dcp.save(tmp, built.model, built.optimizer)
            self._commit(path, state, meter.good_until())
        return path

    def finish(self) -> None:
        """Wait for the save in flight, if any, and make it a checkpoint (collective)."""
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.future.result()  # a failed write raises here, on the process it failed on
            self._commit(pending.path, pending.state, pending.good_until)

    def _commit(self, path: Path, state: dict[str, Any] | None, good_until: int) -> None:
        ctx = self.built.dist
        ctx.barrier()  # every process's shards are written
        if ctx.is_main:
            if path.exists():  # the same step saved before (a resumed run that stopped again)
                shutil.rmtree(path)
            ckpt.write_train_state_atomic(path, state)
            c = self.built.cfg.checkpoint
            self.last_good = ckpt.prune(self.run.checkpoints, keep_last=c.keep_last,
                                        keep_every=c.keep_every, keep_before=good_until)  # fmt: skip
        ctx.barrier()

    def final_weights(self) -> None:
        """FSDP's shards gathered into a whole model on rank 0's host (a collective), or DDP's
        replica, written by rank 0."""
        built = self.built
        if _refuse_non_finite(built, "model.safetensors"):
            return
        model = built.model
        if built.dist.strategy == "fsdp":
            full = dcp.full_model_state(model)  # the tensors land on rank 0's host
            if not built.dist.is_main:
                return
            with torch.device("meta"):
                model = make_model(built.cfg)
            model.to_empty(device="cpu")
            model.load_state_dict(full)
            model.tie_weights()
        if built.dist.is_main:
            write_safetensors(model, self.run.path / "model.safetensors")
