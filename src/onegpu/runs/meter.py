"""What the loop logs, gathered without syncing: the backend sums step outputs on the device
(`Totals`) and they are read back once per log interval (`flush`), the one host-device sync of
the loop. No framework import: the totals, the clock sync and the memory reading are the
backend's."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any, Protocol


class Totals(Protocol):
    """A backend's device-side sums of the step outputs of a log interval."""

    def add(self, out: Any) -> None:
        """Account one step's output (device-side adds only)."""

    def read(self) -> dict[str, float]:
        """loss_sum, skipped, in_a_row, grad_norm (the last step's) and lr, read once."""

    def in_a_row(self) -> int:
        """Updates skipped in a row up to now (read from the device: a sync)."""

    def reset_interval(self) -> None: ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


class Meter:
    """Steps, tokens, intervals and their speed; `peak` has the `flops` MFU is measured
    against (None: no MFU)."""

    def __init__(
        self,
        totals: Totals,
        flops_per_token: int,
        peak: Any | None,
        *,
        sync: Callable[[], None] = lambda: None,
        peak_memory: Callable[[], int] = lambda: 0,
        extras: Callable[[], dict[str, Any]] = dict,
    ):
        self.totals, self.flops_per_token, self.peak = totals, flops_per_token, peak
        self._sync, self._peak_memory, self._extras = sync, peak_memory, extras
        self.skipped_in_a_row = 0
        self._left_s, self._left_tokens, self._left_steps = 0.0, 0, 0  # see leave_out
        self._left_trained = 0
        self.steps = self.tokens = self.trained = 0  # whole run
        self._steps = self._tokens = self._trained = 0  # this interval
        self.masked = False  # some targets carry no loss (instruction and chat data)
        # (tokens/s, mfu, trained tokens/s) per interval
        self.intervals: list[tuple[float, float | None, float | None]] = []
        self.skipped = 0
        self.loss = float("nan")
        self.t_start = self._t_last = time.perf_counter()
        self.first_step_s = float("nan")
        self._first = True

    def state_dict(self) -> dict:
        """The counts and the open log interval (a resumed run logs the same rows)."""
        return {
            "tokens": self.tokens,
            **self.totals.state_dict(),
            "interval_steps": self._steps,
            "interval_tokens": self._tokens,
            "trained": self.trained,
            "interval_trained": self._trained,
        }

    def resume(self, steps: int, state: dict) -> None:
        """Continue the counts of a resumed run."""
        self.steps = steps
        if not state:
            return
        self.tokens = int(state["tokens"])
        self.totals.load_state_dict(state)
        self._steps, self._tokens = int(state["interval_steps"]), int(state["interval_tokens"])
        self.trained = int(state.get("trained", 0))  # older checkpoints did not count them
        self._trained = int(state.get("interval_trained", 0))

    def add(self, out: Any, tokens: int, trained: int | None = None) -> None:
        """Account one step (device-side adds only); `trained`: its targets that carry loss
        (None: all of them)."""
        self.totals.add(out)
        trained = tokens if trained is None else trained
        self.masked = self.masked or trained != tokens
        self._steps += 1
        self._tokens += tokens
        self._trained += trained
        self.steps += 1
        self.tokens += tokens
        self.trained += trained
        if self._first:  # the first step, compilation and warm-up included
            self._first = False
            self._sync()
            self.first_step_s = time.perf_counter() - self.t_start

    def leave_out(self, seconds: float, tokens: int, trained: int | None = None) -> None:
        """The last step ran under the memory profiler: its time and tokens count in no speed
        figure (its loss, tokens and step count stay in the run's totals)."""
        self._left_s += seconds
        self._left_tokens += tokens
        self._left_trained += tokens if trained is None else trained
        self._left_steps += 1

    def good_until(self) -> int:
        """The last step before the current run of skipped updates (this step if none)."""
        return self.steps - self.totals.in_a_row()

    def flush(self) -> dict[str, Any]:
        """The log row of the interval since the last flush (reads the device once)."""
        self._sync()
        dt = max(time.perf_counter() - self._t_last - self._left_s, 1e-9)
        v = self.totals.read()
        self.loss = v["loss_sum"] / self._steps
        self.skipped, self.skipped_in_a_row = int(v["skipped"]), int(v["in_a_row"])
        timed_steps = self._steps - self._left_steps
        tok_s = (self._tokens - self._left_tokens) / dt
        trained_s = (self._trained - self._left_trained) / dt if self.masked else None
        mfu = tok_s * self.flops_per_token / self.peak.flops if self.peak else None
        row = {
            "step": self.steps,
            "loss": self.loss,
            "lr": v["lr"],
            "grad_norm": v["grad_norm"],
            "tokens_per_s": tok_s,
            "trained_tokens_per_s": trained_s,
            "mfu": mfu,
            "step_time_s": dt / timed_steps if timed_steps else None,
            "peak_mem_bytes": self._peak_memory(),
            "skipped_steps": self.skipped,
            **self._extras(),
        }
        if timed_steps:  # an interval of the profiled step alone has no speed
            self.intervals.append((tok_s, mfu, trained_s))
        else:
            row["tokens_per_s"] = row["mfu"] = row["trained_tokens_per_s"] = None
        if not self.masked:
            del row["trained_tokens_per_s"]
        self.totals.reset_interval()
        self._steps = self._tokens = self._left_steps = self._left_tokens = 0
        self._trained = self._left_trained = 0
        self._left_s = 0.0
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
        tok_s = statistics.median(t for t, _, _ in steady) if steady else None
        mfu = statistics.median(m for _, m, _ in steady) if steady and self.peak else None
        trained = [t for _, _, t in steady if t is not None]
        trained_s = statistics.median(trained) if trained else None
        return {"tokens_per_s": tok_s, "mfu": mfu, "trained_tokens_per_s": trained_s}
