"""Where logged rows go: metrics.jsonl (strict JSON, one object per line) and, optionally,
TensorBoard event files (written with the tensorboard package's own writer: no framework)."""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Any

from onegpu.config import ConfigError


class JsonlSink:
    """One strict-JSON object per line, line-buffered: a killed run loses no finished line."""

    def __init__(self, path: Path):
        self._file = open(path, "a", buffering=1)  # noqa: SIM115 (closed in close())

    def log(self, row: dict[str, Any]) -> None:
        self._file.write(json.dumps(strict(row), allow_nan=False) + "\n")

    def close(self) -> None:
        if not self._file.closed:
            self._file.close()


class TensorBoardSink:
    """The rows of metrics.jsonl as TensorBoard scalars (x axis: the optimizer step), under the
    groups TensorBoard shows side by side: train/, eval/, speed/, memory/. A resumed run
    appends to the same folder; TensorBoard keeps the newest value of a repeated step."""

    TAGS = {
        "loss": "train/loss",
        "lr": "train/lr",
        "grad_norm": "train/grad_norm",
        "loss_scale": "train/loss_scale",
        "skipped_steps": "train/skipped_steps",
        "val_loss": "eval/loss",
        "val_ppl": "eval/perplexity",
        "tokens_per_s": "speed/tokens_per_s",
        "mfu": "speed/mfu",
        "step_time_s": "speed/step_time_s",
        "peak_mem_bytes": "memory/peak_bytes",
    }

    def __init__(self, folder: Path):
        try:
            from tensorboard.compat.proto.event_pb2 import Event
            from tensorboard.compat.proto.summary_pb2 import Summary
            from tensorboard.summary.writer.event_file_writer import EventFileWriter
        except ImportError:
            raise ConfigError(
                "out.tensorboard", "needs the tensorboard package: pip install tensorboard"
            ) from None
        self._event, self._summary = Event, Summary
        self._writer = EventFileWriter(str(folder))

    def log(self, row: dict[str, Any]) -> None:
        values = [
            self._summary.Value(tag=tag, simple_value=float(row[key]))
            for key, tag in self.TAGS.items()
            if isinstance(row.get(key), (int, float)) and math.isfinite(row[key])
        ]
        event = self._event(
            wall_time=time.time(), step=int(row["step"]), summary=self._summary(value=values)
        )
        self._writer.add_event(event)
        self._writer.flush()  # one flush per logged row: a killed run loses nothing logged

    def close(self) -> None:
        self._writer.close()


def strict(value: Any) -> Any:
    """Non-finite floats as null: strict JSON parsers reject NaN and Infinity."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: strict(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [strict(v) for v in value]
    return value
