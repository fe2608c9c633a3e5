"""A small model's GPU step waits on its host's launches, not on the GPU: the plan counts the
ops of the step it follows and prices each at the host's measured time (plan/targets.py)."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from onegpu.backends.torch.build import build
from onegpu.backends.torch.loader import count_targets
from onegpu.config import load_config
from onegpu.plan.memory import plan_memory
from onegpu.plan.report import plan_report
from onegpu.plan.targets import HOST_SECONDS_PER_OP
from onegpu.plan.tracker import NO_KERNEL


class _Launches(TorchDispatchMode):
    """A real step's ops that run a kernel, counted as the planner means to count them."""

    def __init__(self):
        super().__init__()
        self.n = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace == "aten" and not func.is_view and func.overloadpacket not in NO_KERNEL:
            self.n += 1
        return func(*args, **(kwargs or {}))


def _cfg(**over):
    values = {"train.device": "cpu", "model.dropout": "0", "model.attention": "sdpa",
              "memory.loss_chunk": "0", "train.batch_size": "8", **over}  # fmt: skip
    return load_config("tiny", overrides=values)


IN_BACKWARD = {"optim.in_backward": "true", "optim.grad_clip": "0"}


@pytest.mark.parametrize(
    "over",
    [pytest.param({"train.micro_batch_size": "8"}, marks=pytest.mark.slow),
     pytest.param({"train.micro_batch_size": "2"}, marks=pytest.mark.slow),
     {"train.micro_batch_size": "2", **IN_BACKWARD}],
    ids=["one micro-batch", "four", "four, the optimizer in the last one's backward"],
)  # fmt: skip
def test_the_plan_counts_the_ops_a_real_step_runs(over):
    """Four micro-batches are followed as two (three where the last steps the optimizer in
    its backward) and extrapolated: the count is a real step's (within a few ops)."""
    cfg = _cfg(**over)
    built = build(cfg, with_data=False)
    tokens = torch.randint(0, cfg.model.vocab_size, (8, cfg.train_seq_len + 1))
    x, y = tokens[:, :-1], tokens[:, 1:]
    built.step(x, y, count_targets(y), 0, None)  # the states: the plan follows a steady step
    with _Launches() as launches:
        built.step(x, y, count_targets(y), 1, None)
    assert plan_memory(cfg).dispatched_ops == pytest.approx(launches.n, rel=0.01)


def test_a_small_models_gpu_step_is_priced_at_its_hosts_launches():
    """tiny on an H200: microseconds of FLOPs, a few hundred launches; the plan's step is
    the launches' time, and the report says the host bounds it."""
    report = plan_report(_cfg(**{"train.micro_batch_size": "8"}), "H200-141", None)
    assert report["bound"] == "dispatch"
    assert report["predicted_compute_s"] < 0.01 * report["predicted_dispatch_s"]
    assert report["predicted_step_time_s"] == pytest.approx(
        report["dispatched_ops"] * HOST_SECONDS_PER_OP
    )
    compiled = plan_report(_cfg(**{"train.compile": "default"}), "H200-141", None)
    assert compiled["bound"] == "compute" and compiled["predicted_dispatch_s"] is None
