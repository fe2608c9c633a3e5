"""`onegpu tune --world-size N`: candidates the distributed build accepts, planned per process."""

from __future__ import annotations

import json

import pytest

from onegpu.cli import main
from onegpu.config import (
    ConfigError,
    check_distributed,
    load_config,
    resolve_strategy,
    with_overrides,
)
from onegpu.tools.tune import candidates, planned_peak


@pytest.mark.slow  # every candidate checked by the distributed build's rules (~5 s)
def test_world_size_candidates_are_only_what_torchrun_runs():
    cfg = load_config("tiny", overrides={"train.batch_size": "8", "train.device": "cpu"})
    cands = candidates(cfg, "cuda", with_compile=True, world_size=2)
    assert cands
    for change in cands:
        changed = with_overrides(cfg, change)
        check_distributed(changed, resolve_strategy(changed.dist, 2), 2)  # raises if refused
        assert 8 % (int(change["train.micro_batch_size"]) * 2) == 0
    seen = {k: {c[k] for c in cands} for k in cands[0]}
    assert seen["dist.strategy"] == {"fsdp", "ddp"}
    assert seen["dist.tp"] == {"1", "2"}  # tensor parallelism joins the mesh search
    assert seen["dist.cpu_offload"] == {"false", "true"}  # tried on a GPU, FSDP only
    assert all(c["dist.strategy"] == "fsdp" for c in cands if c["dist.cpu_offload"] == "true")
    assert seen["train.precision"] == {"bf16"}  # bf16-pure is refused under torchrun
    assert seen["optim.name"] == {"adamw"}
    assert seen["train.micro_batch_size"] == {"1", "2", "4"}
    # one process keeps its own space: no strategy, the whole batch as a micro-batch
    single = candidates(cfg, "cuda", with_compile=False)
    assert "dist.strategy" not in single[0]
    assert {c["train.micro_batch_size"] for c in single} == {"1", "2", "4", "8"}


@pytest.mark.slow
def test_world_size_budget_is_rank_zeros_planned_peak():
    cfg = load_config(
        "small",
        overrides={"train.device": "cpu", "train.batch_size": "8", "train.micro_batch_size": "4"},
    )
    one = planned_peak(cfg, "cpu", 1)
    fsdp = planned_peak(with_overrides(cfg, {"dist.strategy": "fsdp"}), "cpu", 2)
    ddp = planned_peak(with_overrides(cfg, {"dist.strategy": "ddp"}), "cpu", 2)
    assert fsdp < ddp < one  # DDP halves the activations only, FSDP also the states


def test_world_size_the_batch_does_not_split_into_is_one_clear_error(capsys):
    args = ["tune", "--preset", "tiny", "--train.batch_size", "3", "--train.micro_batch_size", "1"]
    assert main([*args, "--memory", "10000000000", "--world-size", "2"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("onegpu: error: --world-size:") and "multiple of 2" in err


@pytest.mark.slow
def test_tune_world_size_launches_torchrun_trials(tmp_path):
    out = tmp_path / "tune"
    args = ["tune", "--preset", "tiny", "--train.device", "cpu", "--memory", "2000000000"]
    assert main([*args, "--world-size", "2", "--time-budget", "1", "--steps", "5", "--out", str(out)]) == 0  # fmt: skip
    result = json.loads((out / "tune.json").read_text())
    assert result["world_size"] == 2
    best = result["best"]
    assert best["change"]["dist.strategy"] in ("fsdp", "ddp")
    assert best["peak_mem_kind"].startswith("highest of 2 ranks'")
    assert best["tokens_per_s"] > 0 and best["loss"] < 6.0
    assert "dist" in (out / "best.toml").read_text()


def test_world_size_zero_is_refused():
    cfg = load_config("tiny", overrides={"train.device": "cpu"})
    with pytest.raises(ConfigError, match="world-size"):
        planned_peak(with_overrides(cfg, {"dist.strategy": "fsdp"}), "cpu", 0)


@pytest.mark.slow  # the candidates of 2 processes, each checked (~5 s)
def test_candidates_for_torchruns_processes_are_planned_with_their_threads(tmp_path, monkeypatch):
    """On this CPU the trials run under torchrun, 1 thread each where OMP_NUM_THREADS is
    unset: their plans time kernels (cached per thread count) with 1 thread too, and this
    process's threads are as they were after."""
    import torch

    from onegpu.tools import tune as tune_module

    seen = []

    def plan(cfg, cands, budget_bytes, target, world_size):
        seen.append(torch.get_num_threads())
        return [(cands[0], budget_bytes + 1)], []  # nothing fits: tune ends there

    monkeypatch.setattr(tune_module, "plan_candidates", plan)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    cfg = load_config("tiny", overrides={"train.batch_size": "8", "train.device": "cpu"})
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        with pytest.raises(ConfigError, match="nothing fits"):
            tune_module.tune(cfg, budget_bytes=10**9, target="cpu", time_budget_s=1, steps=2,
                             out_dir=tmp_path, preset="tiny", config_file=None,
                             base_overrides={}, world_size=2)  # fmt: skip
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)
    assert seen == [1]
