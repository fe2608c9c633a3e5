"""The meter's speed figures leave out what is not training: a step run under the memory
profiler (`train.measure_memory`) counts in the losses and totals but in no tokens/s."""

import time

import pytest

from onegpu.runs.meter import Meter


class _Totals:
    def __init__(self):
        self.loss, self.n = 0.0, 0

    def add(self, out):
        self.loss += out
        self.n += 1

    def read(self):
        return {"loss_sum": self.loss, "skipped": 0, "in_a_row": 0, "grad_norm": 1.0, "lr": 0.1}

    def in_a_row(self):
        return 0

    def reset_interval(self):
        self.loss = 0.0

    def state_dict(self):
        return {}

    def load_state_dict(self, state):
        pass


def test_a_profiled_step_is_left_out_of_the_speed_but_not_the_loss():
    meter = Meter(_Totals(), flops_per_token=0, peak=None)
    meter.add(2.0, 100)  # an ordinary step
    slow = time.perf_counter()
    time.sleep(0.3)  # the profiled step: slow
    meter.leave_out(time.perf_counter() - slow, 100)
    meter.add(4.0, 100)
    row = meter.flush()
    assert row["loss"] == 3.0 and meter.tokens == 200 and meter.steps == 2
    assert row["step_time_s"] < 0.1  # the one timed step, not (0.3 + it) / 2
    assert row["tokens_per_s"] > 1000


def test_an_interval_of_the_profiled_step_alone_has_no_speed():
    meter = Meter(_Totals(), flops_per_token=0, peak=None)
    meter.leave_out(0.2, 100)
    meter.add(1.0, 100)
    row = meter.flush()
    assert row["tokens_per_s"] is None and row["step_time_s"] is None and row["loss"] == 1.0
    assert meter.intervals == []
    meter.add(1.0, 100)
    assert meter.flush()["tokens_per_s"] > 0  # the next interval is timed again


def test_trained_tokens_are_counted_beside_all_tokens_where_targets_are_masked():
    plain = Meter(_Totals(), flops_per_token=0, peak=None)
    plain.add(1.0, 100, 100)
    assert "trained_tokens_per_s" not in plain.flush() and not plain.masked
    meter = Meter(_Totals(), flops_per_token=0, peak=None)
    for _ in range(3):
        meter.add(1.0, 100, 25)  # a quarter of the targets are answers
    row = meter.flush()
    assert meter.trained == 75 and meter.tokens == 300
    assert row["trained_tokens_per_s"] == pytest.approx(row["tokens_per_s"] / 4)
    state = meter.state_dict()
    resumed = Meter(_Totals(), flops_per_token=0, peak=None)
    resumed.resume(3, state)
    assert resumed.trained == 75
