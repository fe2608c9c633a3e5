"""Checkpointing by budget (`memory.checkpointing budget:BYTES`): the per-block plan it picks is
planned within the budget, measured where it was planned, recomputes least among what fits,
and says in one line what it cannot do."""

import random

import pytest

from onegpu.backends.torch.step_memory import measure_real_step
from onegpu.cli import main
from onegpu.config import load_config, parse_checkpointing, per_block_mode, with_overrides
from onegpu.perf.flops import RECOMPUTE
from onegpu.plan.budget import block_costs, cheapest_mix, plan_budget
from onegpu.plan.memory import plan_memory

SHAPES = {
    "tiny-6": {"model.n_layer": "6"},
    "wide": {"model.n_layer": "4", "model.d_model": "128", "model.n_head": "4"},
    "long": {"model.n_layer": "3", "model.seq_len": "256", "train.micro_batch_size": "2"},
}


def _cfg(shape: str, **over: str):
    base = {"train.device": "cpu", "model.dropout": "0", "train.precision": "fp32"}
    return load_config("tiny", overrides={**base, **SHAPES[shape], **over})


def test_a_per_block_plan_reads_back_as_written():
    mode = per_block_mode(["none", "none", "selective", "block", "block", "none"])
    assert mode == "blocks:none*2,selective,block*2,none"
    assert parse_checkpointing(mode).per_block == (
        "none", "none", "selective", "block", "block", "none"
    )  # fmt: skip
    assert parse_checkpointing("budget:auto").budget == 0
    assert parse_checkpointing("budget:123").budget == 123


def test_the_knapsack_recomputes_least_among_the_mixes_that_fit():
    """Exhaustively, on three blocks: what it picks fits the model, and no mix that fits with
    room for the knapsack's rounding (a step of its byte axis per block) recomputes less."""
    import itertools
    import math

    from onegpu.plan.budget import STEPS

    costs = block_costs(_cfg("tiny-6", **{"model.n_layer": "3"}), "cpu", None)
    policies = list(costs.saved)

    def peak(mix):
        return costs.rest() + sum(costs.weight(p, i) for i, p in enumerate(mix))

    for budget in range(min(costs.peaks.values()), costs.peaks["none"], 150_000):
        chosen = cheapest_mix(costs, budget)
        margin = 3 * math.ceil((budget - costs.rest()) / STEPS)
        fitting = [m for m in itertools.product(policies, repeat=3) if peak(m) <= budget - margin]
        if chosen is None:
            assert not fitting
            continue
        assert peak(chosen) <= budget
        if fitting:
            least = min(sum(RECOMPUTE[p] for p in mix) for mix in fitting)
            assert sum(RECOMPUTE[p] for p in chosen) <= least + 1e-9


@pytest.mark.slow  # ~13 s: eight plans and a real step
def test_a_budget_is_planned_within_and_measured_where_planned():
    cfg = _cfg("tiny-6")
    none = plan_memory(cfg).memory["peak"]
    budget = int(none * 0.8)
    resolved, decided = plan_budget(
        with_overrides(cfg, {"memory.checkpointing": f"budget:{budget}"}), "cpu", None, None
    )
    assert decided["planned_peak"] <= budget < none
    assert 1.0 < decided["recompute_factor"] < RECOMPUTE["block"]
    assert resolved.memory.checkpointing == decided["checkpointing"]
    _, measured = measure_real_step(resolved)
    assert measured["peak"] == pytest.approx(decided["planned_peak"], rel=0.05)


@pytest.mark.slow  # ~2 min: 21 budgets, each verified by a full plan
def test_twenty_random_budgets_on_three_shapes_are_planned_within():
    rng = random.Random(0)
    for shape in SHAPES:
        cfg = _cfg(shape)
        costs = block_costs(cfg, "cpu", None)
        low, high = min(costs.peaks.values()), costs.peaks["none"]
        for _ in range(7):
            budget = rng.randint(low, high)
            resolved, decided = plan_budget(
                with_overrides(cfg, {"memory.checkpointing": f"budget:{budget}"}), "cpu", None, None
            )
            assert decided["planned_peak"] <= budget, (shape, budget)
            assert plan_memory(resolved).memory["peak"] == decided["planned_peak"]


@pytest.mark.slow  # moved from the fast run to keep it under 5 minutes
def test_a_budget_below_what_the_step_needs_says_the_minimum(capsys):
    args = ["train", "--preset", "tiny", "--train.device", "cpu", "--memory.checkpointing",
            "budget:1000"]  # fmt: skip
    assert main(args) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("onegpu: error: memory.checkpointing: budget:1000 is below")
    assert "at least" in err and len(err.splitlines()) == 1


def test_a_budget_is_refused_where_it_cannot_be_decided(capsys):
    assert main(["plan", "--preset", "tiny", "--memory.checkpointing", "budget:auto"]) == 2
    assert "budget:auto takes the device's memory" in capsys.readouterr().err
    args = ["train", "--preset", "tiny", "--train.backend", "jax", "--memory.checkpointing",
            "budget:100000000"]  # fmt: skip
    assert main(args) == 2
    assert "memory.checkpointing" in capsys.readouterr().err


@pytest.mark.slow  # ~15 s: the decision and a two-step run
def test_a_run_records_its_decision_and_a_resume_keeps_it(tmp_path):
    from onegpu.runs.checkpoints import keep_decisions
    from onegpu.train import train

    cfg = _cfg("tiny-6")
    budget = int(plan_memory(cfg).memory["peak"] * 0.8)
    over = {"memory.checkpointing": f"budget:{budget}", "train.max_steps": "2",
            "out.dir": str(tmp_path), "out.progress": "false", "train.eval_every": "0"}  # fmt: skip
    run_cfg = with_overrides(cfg, over)
    train(run_cfg)
    written = load_config(None, str(tmp_path / "config.toml"))
    assert written.memory.checkpointing.startswith("blocks:")
    saved = {"memory": {"checkpointing": written.memory.checkpointing}}
    kept = keep_decisions(saved, run_cfg)
    assert kept.memory.checkpointing == written.memory.checkpointing


@pytest.mark.parametrize(
    ("over", "says"),
    [
        ({"memory.checkpointing": "budget-compiled:0.5"}, "--train.compile regional"),
        (
            {
                "memory.checkpointing": "budget-compiled:0.5",
                "train.compile": "regional",
                "model.dropout": "0.1",
            },
            "#190758",
        ),  # fmt: skip
        ({"memory.checkpointing": "budget-compiled:2"}, "from 0 to 1"),
    ],
)
def test_budget_compiled_is_refused_where_it_would_be_wrong(over, says, capsys):
    args = ["train", "--preset", "tiny", "--model.dropout", "0"]
    for k, v in over.items():
        args += [f"--{k}", v]
    assert main(args) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("onegpu: error: memory.checkpointing:") and says in err
    assert len(err.splitlines()) == 1


@pytest.mark.slow  # compiles twice (~1 min on a CPU)
def test_budget_compiled_hands_the_choice_to_the_partitioner_and_keeps_the_losses(tmp_path):
    import json

    import torch._functorch.config as functorch_config

    from onegpu.backends.torch.build import build

    def losses(mode: str) -> list[float]:
        over = {"train.compile": "regional", "memory.checkpointing": mode, "train.max_steps": "3",
                "out.dir": str(tmp_path / mode.replace(":", "-")), "out.progress": "false",
                "train.eval_every": "0", "train.log_every": "1"}  # fmt: skip
        from onegpu.train import train

        train(_cfg("tiny-6", **over))
        rows = (tmp_path / mode.replace(":", "-") / "metrics.jsonl").read_text().splitlines()
        return [json.loads(r)["loss"] for r in rows if "loss" in json.loads(r)]

    assert losses("budget-compiled:0.0") == pytest.approx(losses("none"), rel=1e-5)
    build(_cfg("tiny-6", **{"memory.checkpointing": "budget-compiled:0.25",
                            "train.compile": "regional"}), with_data=False)  # fmt: skip
    assert functorch_config.activation_memory_budget == 0.25
    build(_cfg("tiny-6"), with_data=False)
    assert functorch_config.activation_memory_budget == 1.0


@pytest.mark.slow  # ~25 s: the fix list plans its candidates, the budget's six policies each
def test_the_fix_list_offers_checkpointing_by_budget():
    """With the states, the precision and the loss already lean and one sequence a
    micro-batch, what is left between selective and block checkpointing is a per-block mix:
    offered as budget:auto, which fits when planned in full."""
    from onegpu.plan.fixes import fixes_for, planned

    over = {"train.precision": "bf16-pure", "optim.name": "adamw4bit", "memory.loss_chunk": "64",
            "train.micro_batch_size": "1", "train.batch_size": "4", "model.seq_len": "256"}  # fmt: skip
    cfg = _cfg("tiny-6", **over)
    peaks = {
        p: plan_memory(with_overrides(cfg, {"memory.checkpointing": p})).memory["peak"]
        for p in ("none", "selective", "block")
    }
    budget = (peaks["selective"] + peaks["block"]) // 2
    found = fixes_for(cfg, budget, "cpu", base_peak=peaks["none"])
    best = found[-1]
    assert best["change"] == "checkpointing by budget" and best["fits_with_previous"]
    assert best["best_overrides"]["memory.checkpointing"] == "budget:auto"
    full = planned(
        with_overrides(cfg, best["best_overrides"]), "cpu", None, None, fast=False, speed=False,
        capacity=budget,
    )  # fmt: skip
    assert full.peak <= budget
