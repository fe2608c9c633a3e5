"""`onegpu tune --gpu NAME` without that GPU: a search by prediction whose arithmetic pruning is
sound (its bounds never exceed what planning finds) and whose winner fits."""

import random

import pytest

from onegpu.config import load_config, with_overrides
from onegpu.perf.devices import GPUS
from onegpu.plan.fixes import planned
from onegpu.plan.targets import gpu_caps
from onegpu.tools.tune import candidates
from onegpu.tools.tune_plan import _floor_policy, activation_floors, bound, search

GPU = "RTX4090"


def _cfg():
    return load_config("tiny", overrides={"train.device": "cpu", "model.n_layer": "4",
                                          "model.dropout": "0.0", "train.batch_size": "8",
                                          "train.micro_batch_size": "8"})  # fmt: skip


@pytest.mark.slow  # ~10 s: a dozen full plans
def test_the_arithmetic_bounds_are_lower_bounds_of_the_plan():
    """Pruning without planning is only sound if no candidate needs less than its bound: a
    sample across every option, each planned in full for the GPU."""
    cfg, caps = _cfg(), gpu_caps(GPU)
    every = candidates(cfg, "cuda", with_compile=False, budget="budget:auto")
    by_budget = [c for c in every if c["memory.checkpointing"] == "budget:auto"]
    cands = random.Random(0).sample(every, 8) + random.Random(0).sample(by_budget, 2)
    floors = activation_floors(cfg, GPU, cands)
    base = planned(cfg, "cuda", caps, GPU, fast=False)
    capacity = GPUS[GPU].memory_bytes  # what budget:auto takes
    for change in cands:
        c = with_overrides(cfg, change)
        key = (_floor_policy(change["memory.checkpointing"]), change["train.precision"])
        b = bound(c, base.n_params, base.flops_per_token, GPU, floors[key])
        p = planned(c, "cuda", caps, GPU, fast=False, capacity=capacity)
        assert b.device <= p.peak and b.host <= p.host, change
        assert b.step_s <= p.step_s * (1 + 1e-9), change


@pytest.mark.slow  # plans every candidate
def test_the_search_returns_the_fastest_planned_candidate_that_fits():
    cfg, caps = _cfg(), gpu_caps(GPU)
    plain = planned(cfg, "cuda", caps, GPU, fast=False)
    budget = plain.peak - 1  # as configured it does not fit
    result = search(cfg, candidates(cfg, "cuda", with_compile=False), GPU, budget, 2**40,
                    log=lambda line: None)  # fmt: skip
    best = result["best"]
    assert best is not None and best["fits"]
    again = planned(with_overrides(cfg, best["change"]), "cuda", caps, GPU, fast=False)
    assert again.peak <= budget
    fitting = [r for r in result["rows"] if r["fits"]]
    assert all(best["step_s"] <= r["step_s"] for r in fitting)
    assert result["pruned_by_arithmetic"] + result["planned"] <= result["candidates"]


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="measures on a GPU here")
@pytest.mark.slow  # a predicted search (7 s)
def test_tune_for_a_gpu_that_is_not_here_writes_a_predicted_best_toml(tmp_path):
    import tomllib

    from onegpu.cli import main

    out = tmp_path / "tune"
    assert main(["tune", "--preset", "tiny", "--gpu", GPU, "--out", str(out)]) == 0
    best = tomllib.loads((out / "best.toml").read_text())
    assert best["train"]["micro_batch_size"] >= 1
    assert "predicted, not measured" in (out / "tune.md").read_text()


@pytest.mark.slow  # ~20 s: the budget decided by its six policies planned
def test_a_measured_search_plans_checkpointing_by_its_budget():
    """Between the uniform policies' peaks, `budget:BYTES` (the search's own budget) fits
    where none and selective do not, and is tried before block: it recomputes less."""
    from onegpu.plan.memory import plan_memory
    from onegpu.tools.tune import estimated_cost, plan_candidates

    cfg = load_config("tiny", overrides={"train.device": "cpu", "model.dropout": "0",
                                         "train.precision": "fp32", "model.n_layer": "6",
                                         "train.micro_batch_size": "1", "train.batch_size": "4",
                                         "model.seq_len": "256", "memory.loss_chunk": "64"})  # fmt: skip
    peaks = {
        p: plan_memory(with_overrides(cfg, {"memory.checkpointing": p})).memory["peak"]
        for p in ("none", "selective", "block")
    }
    budget = (peaks["selective"] + peaks["block"]) // 2
    by_budget = f"budget:{budget}"
    every = candidates(cfg, "cpu", with_compile=False, budget=by_budget)
    assert any(c["memory.checkpointing"] == by_budget for c in every)
    assert all(
        c["memory.checkpointing"] != by_budget
        for c in candidates(cfg, "cpu", with_compile=False, world_size=2, budget=by_budget)
    )  # torchrun runs do not take a budget yet
    cands = [{"train.micro_batch_size": "1", "train.precision": "fp32", "optim.name": "adamw",
              "memory.offload_activations": "false", "memory.offload_optimizer": "false",
              "memory.offload_params": "false", "memory.checkpointing": p}
             for p in ("none", "selective", "block", by_budget)]  # fmt: skip
    _, fitting = plan_candidates(cfg, cands, budget, "cpu", 1)
    fits = {c["memory.checkpointing"]: peak for c, peak in fitting}
    assert set(fits) == {"block", by_budget} and fits[by_budget] <= budget
    assert estimated_cost(cands[3], 4) < estimated_cost(cands[2], 4)
