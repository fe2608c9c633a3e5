"""How a run went, as summary.json says it on both backends: the last loss, the steps done and
why the run ended (finished, a signal, divergence)."""

from __future__ import annotations

import signal
from typing import Any

from onegpu.runs.meter import Meter
from onegpu.runs.signals import GracefulStop


def run_outcome(meter: Meter, stop: GracefulStop, val_loss: float | None) -> dict[str, Any]:
    return {
        "loss": meter.loss,
        "val_loss": val_loss,
        "steps": meter.steps,
        "interrupted": stop.requested,
        "signal": signal.Signals(stop.signum).name if stop.requested else None,
        "diverged": stop.diverged,
        "skipped_steps": meter.skipped,
        "train_time_s": meter.elapsed(),
    }
