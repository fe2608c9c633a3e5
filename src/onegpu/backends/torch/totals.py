"""The torch side of the meter (runs/meter.py): step outputs summed on the device, read back
once per log interval."""

from __future__ import annotations

from typing import Any

import torch

from onegpu.backends.torch.build import Built
from onegpu.backends.torch.step import StepOutput
from onegpu.memory.measure import peak_bytes
from onegpu.perf.devices import Peak, sync
from onegpu.runs.meter import Meter


class DeviceTotals:
    """runs.meter.Totals over torch tensors on the step's device."""

    def __init__(self, device: torch.device):
        self._loss = torch.zeros((), device=device)
        self._skipped = torch.zeros((), dtype=torch.int64, device=device)
        self._in_a_row = torch.zeros((), dtype=torch.int64, device=device)  # skipped lately
        self._last: StepOutput | None = None

    def add(self, out: StepOutput) -> None:
        self._loss += out.loss
        self._skipped += out.skipped
        self._in_a_row.add_(out.skipped).mul_(out.skipped)  # +1 when skipped, else back to 0
        self._last = out

    def read(self) -> dict[str, float]:
        values = torch.stack(
            [
                self._loss.double(),
                self._skipped.double(),
                self._in_a_row.double(),
                self._last.grad_norm.double(),
            ]
        ).tolist()
        return dict(zip(("loss_sum", "skipped", "in_a_row", "grad_norm"), values)) | {
            "lr": self._last.lr
        }

    def in_a_row(self) -> int:
        return int(self._in_a_row.item())

    def reset_interval(self) -> None:
        self._loss.zero_()

    def state_dict(self) -> dict[str, Any]:
        return {
            "skipped": self._skipped.clone(),
            "in_a_row": self._in_a_row.clone(),
            "interval_loss": self._loss.clone(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._skipped.copy_(state["skipped"])
        self._in_a_row.copy_(state["in_a_row"])
        self._loss.copy_(state["interval_loss"])


def meter_for(built: Built, peak: Peak | None) -> Meter:
    """The run's meter: device-side totals, the device's clock sync and peak memory."""
    device = built.device
    return Meter(
        DeviceTotals(device),
        built.flops_per_token,
        peak,
        sync=lambda: sync(device),
        peak_memory=lambda: peak_bytes(device),
        extras=built.step.log_extras,
    )
