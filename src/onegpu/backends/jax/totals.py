"""The JAX side of the meter (runs/meter.py): step outputs kept as device arrays and read
back once per log interval, as the torch backend does; peak memory is the process's RSS."""

from __future__ import annotations

import resource
import sys
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np


@dataclass
class Out:
    """One step's outputs (device arrays) and its learning rate."""

    loss: Any
    grad_norm: Any
    skipped: Any
    lr: float


class HostTotals:
    def __init__(self) -> None:
        self._pending: list[Out] = []
        self._loss = 0.0
        self._skipped = 0
        self._in_a_row = 0
        self._last: tuple[float, float] = (float("nan"), 0.0)  # grad norm, lr

    def add(self, out: Out) -> None:
        self._pending.append(out)

    def _drain(self) -> None:
        if not self._pending:
            return
        got = jax.device_get([(o.loss, o.grad_norm, o.skipped) for o in self._pending])
        for (loss, norm, skipped), out in zip(got, self._pending, strict=True):
            self._loss += float(loss)
            self._skipped += int(skipped)
            self._in_a_row = self._in_a_row + 1 if skipped else 0
            self._last = (float(norm), out.lr)
        self._pending.clear()

    def read(self) -> dict[str, float]:
        self._drain()
        return {
            "loss_sum": self._loss,
            "skipped": self._skipped,
            "in_a_row": self._in_a_row,
            "grad_norm": self._last[0],
            "lr": self._last[1],
        }

    def in_a_row(self) -> int:
        self._drain()
        return self._in_a_row

    def reset_interval(self) -> None:
        self._drain()
        self._loss = 0.0

    def state_dict(self) -> dict[str, Any]:
        self._drain()
        return {
            "skipped": self._skipped,
            "in_a_row": self._in_a_row,
            "interval_loss": np.float64(self._loss),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._skipped, self._in_a_row = int(state["skipped"]), int(state["in_a_row"])
        self._loss = float(state["interval_loss"])


def peak_rss_bytes() -> int:
    """The process's peak resident set (ru_maxrss: KiB on Linux, bytes on macOS)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024
