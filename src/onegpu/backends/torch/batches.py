"""The batches a run's loop takes: this process's share of each global batch from the
training split, and the fixed validation batches."""

from __future__ import annotations

import torch

from onegpu.backends.torch.build import Built
from onegpu.backends.torch.loader import (
    DevicePrefetcher,
    count_targets,
    make_eval_batches,
    make_train_loader,
)
from onegpu.config import DataConfig


def training_batches(built: Built, start_step: int = 0) -> DevicePrefetcher:
    """(inputs, targets, target count, positions) batches from step `start_step` on, copied
    to the device one step ahead: this process's rows of each global batch (all of them on
    one process), with the target count of the whole batch; positions of packed rows (None
    where rows hold one document each)."""
    cfg = built.cfg
    loader = make_train_loader(
        built.data.train_rows,
        batch_size=cfg.train.batch_size,
        seed=cfg.train.seed,
        start=start_step * cfg.train.batch_size,
        num_workers=_num_workers(cfg.data, built.device),
        pin_memory=built.device.type == "cuda",
        classes=built.classes,
    )
    ctx = built.dist

    def share(x, y, *positions):
        mine = ctx.rows(len(x))
        return x[mine], y[mine], count_targets(y), positions[0][mine] if positions else None

    return DevicePrefetcher((share(*batch) for batch in loader), built.device)


def validation_batches(built: Built) -> list[tuple[torch.Tensor, ...]]:
    """The fixed validation batches of every evaluation (none when evaluation is off)."""
    t = built.cfg.train
    if not t.eval_every:
        return []
    return make_eval_batches(
        built.data.val_rows,
        batch_size=t.micro_batch_size,
        n_batches=t.eval_batches,
        classes=built.classes,
    )


def _num_workers(d: DataConfig, device: torch.device) -> int:
    if d.num_workers >= 0:
        return d.num_workers
    return 2 if device.type == "cuda" else 0  # on CPU workers compete with compute for cores
