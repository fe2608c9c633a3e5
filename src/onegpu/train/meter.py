"""What the loop logs, gathered without syncing: step outputs are summed on the device and read
back once per log interval (`flush`), the one host-device sync of the loop."""

from __future__ import annotations

import statistics
import time
from typing import Any

import torch

from onegpu.memory.measure import peak_bytes
from onegpu.perf.devices import Peak
from onegpu.step import StepOutput, TrainStep


class Meter:
    def __init__(self, step: TrainStep, flops_per_token: int, peak: Peak | None):
        self.step, self.flops_per_token, self.peak = step, flops_per_token, peak
        device = step.device
        self._loss = torch.zeros((), device=device)
        self._skipped = torch.zeros((), dtype=torch.int64, device=device)
        self._in_a_row = torch.zeros((), dtype=torch.int64, device=device)  # skipped lately
        self.skipped_in_a_row = 0
        self._last: StepOutput | None = None
        self.steps = self.tokens = 0  # whole run
        self._steps = self._tokens = 0  # this interval
        self.intervals: list[tuple[float, float | None]] = []  # (tokens/s, mfu) per interval
        self.skipped = 0
        self.loss = float("nan")
        self.t_start = self._t_last = time.perf_counter()
        self.first_step_s = float("nan")
        self._first = True

    def state_dict(self) -> dict:
        """The counts and the open log interval (a resumed run logs the same rows)."""
        return {
            "tokens": self.tokens,
            "skipped": self._skipped.clone(),
            "in_a_row": self._in_a_row.clone(),
            "interval_loss": self._loss.clone(),
            "interval_steps": self._steps,
            "interval_tokens": self._tokens,
        }

    def resume(self, steps: int, state: dict) -> None:
        """Continue the counts of a resumed run."""
        self.steps = steps
        if not state:
            return
        self.tokens = int(state["tokens"])
        self._skipped.copy_(state["skipped"])
        self._in_a_row.copy_(state["in_a_row"])
        self._loss.copy_(state["interval_loss"])
        self._steps, self._tokens = int(state["interval_steps"]), int(state["interval_tokens"])

    def add(self, out: StepOutput, tokens: int) -> None:
        """Account one step (device-side adds only)."""
        self._loss += out.loss
        self._skipped += out.skipped
        self._in_a_row.add_(out.skipped).mul_(out.skipped)  # +1 when skipped, else back to 0
        self._last = out
        self._steps += 1
        self._tokens += tokens
        self.steps += 1
        self.tokens += tokens
        if self._first:  # the first step, compilation and warm-up included
            self._first = False
            if self.step.device.type == "cuda":
                torch.cuda.synchronize(self.step.device)
            self.first_step_s = time.perf_counter() - self.t_start

    def flush(self) -> dict[str, Any]:
        """The log row of the interval since the last flush (reads the device once)."""
        if self.step.device.type == "cuda":
            torch.cuda.synchronize(self.step.device)
        dt = time.perf_counter() - self._t_last
        loss_sum, skipped, in_a_row, grad_norm = torch.stack(
            [
                self._loss.double(),
                self._skipped.double(),
                self._in_a_row.double(),
                self._last.grad_norm.double(),
            ]
        ).tolist()
        self.loss = loss_sum / self._steps
        self.skipped, self.skipped_in_a_row = int(skipped), int(in_a_row)
        tok_s = self._tokens / dt
        mfu = tok_s * self.flops_per_token / self.peak.flops if self.peak else None
        row = {
            "step": self.steps,
            "loss": self.loss,
            "lr": self._last.lr,
            "grad_norm": grad_norm,
            "tokens_per_s": tok_s,
            "mfu": mfu,
            "step_time_s": dt / self._steps,
            "peak_mem_bytes": peak_bytes(self.step.device),
            "skipped_steps": self.skipped,
            **self.step.log_extras(),
        }
        self.intervals.append((tok_s, mfu))
        self._loss.zero_()
        self._steps = self._tokens = 0
        self.restart_clock()
        return row

    def elapsed(self) -> float:
        return time.perf_counter() - self.t_start

    def restart_clock(self) -> None:
        """Leave time spent outside training steps (evaluation) out of the next interval."""
        self._t_last = time.perf_counter()

    def steady(self) -> dict[str, float | None]:
        """Medians over the log intervals after the first (which holds warm-up and compilation)."""
        steady = self.intervals[1:] if len(self.intervals) > 1 else self.intervals
        tok_s = statistics.median(t for t, _ in steady) if steady else None
        mfu = statistics.median(m for _, m in steady) if steady and self.peak else None
        return {"tokens_per_s": tok_s, "mfu": mfu}
