"""The run's checkpoint saves: when the weights are finite, the backend writes its state under
the shared name (runs/checkpoints.py), and the folder is pruned once it is on disk. One save is
in flight at a time: a backend may finish one in the background (torch's asynchronous sharded
save); the next save, the last one and a stop on a signal first complete it."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from pathlib import Path

from onegpu.config import Config
from onegpu.runs import checkpoints
from onegpu.runs.backend import Backend, Processes
from onegpu.runs.folder import RunFolder
from onegpu.runs.meter import Meter


class Saver:
    def __init__(self, folder: RunFolder, backend: Backend, cfg: Config, group: Processes):
        self.folder, self.backend, self.cfg, self.group = folder, backend, cfg, group
        self._pending: tuple[Callable[[], None] | None, int] | None = None
        self.last_good: Path | None = None
        """The newest checkpoint from before the updates being skipped now (kept whatever
        checkpoint.keep_last says), as of the last save."""

    def save(self, meter: Meter, *, wait: bool) -> Path | None:
        """Checkpoint the state after `meter.steps` steps (None: weights not finite, not
        saved). Unless `wait`, the backend may finish it in the background."""
        if self._refuse_non_finite(f"step {meter.steps}: checkpoint"):
            return None
        self.finish()
        path = self.folder.checkpoints / checkpoints.checkpoint_name(
            meter.steps, self.backend.checkpoint_suffix
        )
        common = checkpoints.common_state(
            self.cfg,
            backend=self.backend.name,
            step=meter.steps,
            meter=meter.state_dict(),
            data=self.backend.data_fingerprint(),
        )
        complete = self.backend.write_checkpoint(path, common, wait=wait)
        self._pending = (complete, meter.good_until())
        if complete is None or wait:
            self.finish()
        return path

    def finish(self) -> None:
        """Complete the save in flight, if any, and prune (a collective)."""
        pending, self._pending = self._pending, None
        if pending is None:
            return
        complete, good_until = pending
        if complete is not None:
            complete()
        if self.group.is_main:
            c = self.cfg.checkpoint
            self.last_good = checkpoints.prune(
                self.folder.checkpoints,
                keep_last=c.keep_last,
                keep_every=c.keep_every,
                keep_before=good_until,
            )
        self.group.barrier()

    def final_weights(self) -> None:
        """model.safetensors: the trained weights alone, never non-finite ones."""
        if not self._refuse_non_finite("model.safetensors"):
            self.backend.final_weights(self.folder.path / "model.safetensors")

    def _refuse_non_finite(self, what: str) -> bool:
        """True (after a warning from the main process) when the weights are not finite."""
        if self.backend.weights_finite():
            return False
        if self.group.is_main:
            warnings.warn(f"{what}: non-finite weights, not written", stacklevel=3)
        return True
