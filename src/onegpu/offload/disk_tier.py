"""The disk tier (`memory.offload_dir`): the host optimizer's master weights and states in
memory-mapped files on a local disk, for when host memory is short (ZeRO-Infinity's NVMe
offload, Rajbhandari et al., arXiv:2104.07857, for one process).

A tensor here is `torch.from_file(..., shared=True)`: a file mapped into the address space, so
the optimizer reads and writes it like any CPU tensor and the kernel pages it in and out; only
the parameters being stepped need to be resident. The files are the run's scratch space, not
its checkpoints (those are written as always, from these tensors): they live in a folder of
their own, removed when the optimizer is.

States appear at an optimizer's first step (AdamW's `zeros_like` in RAM). So that they never
all exist in RAM at once, the first step runs one parameter at a time (each optimizer's update
of a parameter depends on that parameter alone, so the result is bit-identical) and moves each
parameter's new states to files before stepping the next.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import weakref
from pathlib import Path
from typing import Any

import torch

from onegpu.config import ConfigError


def check_offload_dir(path: str) -> Path:
    """The folder, created if missing; ConfigError naming memory.offload_dir if it cannot be
    written to."""
    folder = Path(path).expanduser()
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=folder, prefix=".onegpu-write-test-"):
            pass
    except OSError as e:
        raise ConfigError(
            "memory.offload_dir",
            f"{folder} is not a writable folder ({e.strerror or type(e).__name__}); give a "
            "folder on a local disk with room for the optimizer's states",
        ) from None
    return folder


class DiskTier:
    """File-backed tensors in a scratch folder of their own under `root`."""

    def __init__(self, root: str):
        base = check_offload_dir(root)
        self.dir = Path(tempfile.mkdtemp(prefix=f"onegpu-offload-{os.getpid()}-", dir=base))
        self._count = 0
        self._finalizer = weakref.finalize(self, shutil.rmtree, self.dir, True)

    def tensor_like(self, t: torch.Tensor) -> torch.Tensor:
        """A file-backed copy of `t` (a plain CPU tensor of the same shape and dtype)."""
        if t.numel() == 0:
            return t.detach().clone()
        self._count += 1
        path = self.dir / f"{self._count}.bin"
        mapped = torch.from_file(str(path), shared=True, size=t.numel(), dtype=t.dtype)
        mapped = mapped.view(t.shape)
        mapped.copy_(t.detach())
        return mapped

    def holds(self, t: torch.Tensor) -> bool:
        filename = getattr(t.untyped_storage(), "filename", None)
        return bool(filename) and Path(filename).parent == self.dir

    def move_state(self, state: dict[str, Any]) -> None:
        """Every tensor of one parameter's optimizer state onto the disk (a scalar `step`
        stays: it is read every step and weighs nothing)."""
        for key, value in state.items():
            if isinstance(value, torch.Tensor) and value.numel() > 1:
                state[key] = self._to_disk(value)

    def _to_disk(self, t: torch.Tensor) -> torch.Tensor:
        if type(t) is not torch.Tensor and hasattr(t, "__tensor_flatten__"):
            # a tensor subclass (torchao's 8-bit states: codes, scales): its inner tensors
            names, _ = t.__tensor_flatten__()
            for name in names:
                setattr(t, name, self._to_disk(getattr(t, name)))
            return t
        return t if self.holds(t) else self.tensor_like(t)

    def nbytes(self) -> int:
        return sum(f.stat().st_size for f in self.dir.glob("*.bin"))

    def close(self) -> None:
        self._finalizer()


def step_into_disk(optimizer: torch.optim.Optimizer, disk: DiskTier) -> None:
    """One step of `optimizer`, a parameter at a time, each parameter's states moved to disk
    as soon as they exist (the first step; later ones step as usual, on the files)."""
    groups = optimizer.param_groups
    saved = [g["params"] for g in groups]
    try:
        for g in groups:
            g["params"] = []
        for g, params in zip(groups, saved, strict=True):
            for p in params:
                g["params"] = [p]
                optimizer.step()
                if p in optimizer.state:
                    disk.move_state(optimizer.state[p])
            g["params"] = []
    finally:
        for g, params in zip(groups, saved, strict=True):
            g["params"] = params
