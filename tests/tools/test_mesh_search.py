"""The search over device meshes (`onegpu tune --gpu NAME --world-size N`, `onegpu plan
--world-size N`'s fix list): every layout tried, sound arithmetic skips, the fastest predicted
candidate that fits returned and written."""

import dataclasses
import random

import pytest
import tomllib

from onegpu.cli import main
from onegpu.config import check_distributed, load_config, resolve_strategy, with_overrides
from onegpu.config.layout import resolve_layout
from onegpu.perf.devices import CUBLAS_HANDLES, GPUS
from onegpu.plan.mesh_search import (
    candidates,
    largest_rank,
    layouts,
    lower_bound,
    model_facts,
    search_meshes,
)
from onegpu.plan.targets import gpu_caps

GPU = "A10G"


def _cfg(**extra: str):
    over = {"train.device": "cpu", "model.n_layer": "4", "model.dropout": "0.0",
            "model.tie_embeddings": "false", "train.batch_size": "8",
            "train.micro_batch_size": "2", "train.precision": "bf16", **extra}  # fmt: skip
    return load_config("tiny", overrides=over)


def test_every_layout_of_the_world_size_is_a_candidate_the_build_accepts():
    assert len(layouts(8)) == 20  # ordered factorings of 2^3 into four dimensions
    assert all(layout.world_size == 8 for layout in layouts(8))
    cfg = _cfg()
    cands = candidates(cfg, 4)
    for change in cands:
        c = with_overrides(cfg, change)
        check_distributed(c, resolve_strategy(c.dist, 4), 4)  # raises if refused
    shapes = {resolve_layout(with_overrides(cfg, c).dist, 4).describe() for c in cands}
    assert {"dp_shard 4", "dp_replicate 4", "tp 4", "pp 4", "dp_shard 2 x tp 2",
            "pp 2 x dp_shard 2", "dp_replicate 2 x dp_shard 2", "pp 2 x tp 2"} <= shapes  # fmt: skip
    assert {c["memory.checkpointing"] for c in cands} == {"none", "selective", "block"}
    # a layout alone keeps the user's checkpointing and micro-batch
    alone = candidates(cfg, 4, vary_techniques=False)
    assert {(c["memory.checkpointing"], c["train.micro_batch_size"]) for c in alone} == {
        ("none", "2")
    }


@pytest.mark.slow  # ~40 s: a dozen ranks of meshes planned in full
def test_the_arithmetic_skip_never_exceeds_the_planned_largest_rank():
    """Skipping a candidate unplanned is sound only if its lower bound never exceeds what
    planning finds: a sample across every layout and policy, each planned in full."""
    cfg, caps = _cfg(), gpu_caps(GPU)
    cands = random.Random(0).sample(candidates(cfg, 4), 10)
    model = model_facts(cfg, {c["memory.checkpointing"] for c in cands}, "cuda", caps)
    for change in cands:
        c = with_overrides(cfg, change)
        peak, _ = largest_rank(c, "cuda", caps, 4)
        assert 0 < lower_bound(c, resolve_layout(c.dist, 4), model) <= peak, change


@pytest.mark.slow  # ~20 s
def test_the_search_plans_fastest_first_and_stops_at_the_first_that_fits():
    cfg, caps = _cfg(), gpu_caps(GPU)
    plain, _ = largest_rank(with_overrides(cfg, {"dist.strategy": "fsdp"}), "cuda", caps, 4)
    held = CUBLAS_HANDLES * caps.blas_workspace  # every rank's, whatever its layout
    budget = held + (plain - held) // 2  # FSDP over 4 as configured does not fit
    result = search_meshes(cfg, GPU, caps, 4, "pcie4", budget, 2**40)
    rows, best = result["rows"], result["best"]
    assert best is not None and best is rows[-1] and best["peak_bytes"] <= budget
    assert not any(r["fits"] for r in rows[:-1])
    assert [r["step_s"] for r in rows] == sorted(r["step_s"] for r in rows)
    chosen = with_overrides(cfg, best["change"])
    assert largest_rank(chosen, "cuda", caps, 4)[0] <= budget
    assert result["planned"] + result["skipped_by_arithmetic"] <= result["candidates"]


@pytest.fixture
def small_gpu(monkeypatch):
    """A GPU of the table with just enough memory that the test's model needs the search."""
    name = "test-gpu"
    monkeypatch.setitem(GPUS, name, dataclasses.replace(GPUS[GPU], memory_bytes=692 * 2**20))
    return name


@pytest.mark.slow  # ~30 s
def test_plan_offers_a_mesh_when_data_parallelism_alone_does_not_fit(small_gpu, tmp_path, capsys):
    best = tmp_path / "best.toml"
    args = ["plan", "--preset", "tiny", "--model.n_layer", "4", "--model.dropout", "0",
            "--model.tie_embeddings", "false", "--model.d_model", "512", "--model.seq_len", "512",
            "--train.batch_size", "8", "--train.micro_batch_size", "2", "--gpu", small_gpu,
            "--world-size", "2", "--best-toml", str(best)]  # fmt: skip
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "DOES NOT FIT" in out and "layouts of 2 processes" in out and "FITS" in out
    written = tomllib.loads(best.read_text())
    cfg = load_config(None, str(best))
    peak, _ = largest_rank(cfg, "cuda", gpu_caps(small_gpu), 2)
    assert peak <= GPUS[small_gpu].memory_bytes - 2**29
    assert written["dist"]["dp_shard"] * written["dist"]["tp"] * written["dist"]["pp"] <= 2


@pytest.mark.slow  # plans the FSDP layouts at sequence 2048 before the one that fits (~1 min)
def test_plan_offers_tensor_parallelism_when_sharding_the_states_is_not_enough(
    small_gpu, tmp_path, capsys
):
    """Sequence 2048: activations dominate, FSDP shards none of them, so no FSDP or DDP layout
    fits however it checkpoints; TP 2's sequence-parallel blocks halve them, and the plan's
    fix list ends on a layout that splits the model."""
    best = tmp_path / "best.toml"
    args = ["plan", "--preset", "tiny", "--model.n_layer", "4", "--model.dropout", "0",
            "--model.tie_embeddings", "false", "--model.d_model", "512", "--model.seq_len", "2048",
            "--train.batch_size", "8", "--train.micro_batch_size", "2", "--gpu", small_gpu,
            "--world-size", "2", "--best-toml", str(best)]  # fmt: skip
    assert main(args) == 0
    assert "FITS" in capsys.readouterr().out
    written = tomllib.loads(best.read_text())["dist"]
    assert written["tp"] > 1 or written["pp"] > 1, written
    cfg = load_config(None, str(best))
    peak, _ = largest_rank(cfg, "cuda", gpu_caps(small_gpu), 2)
    assert peak <= GPUS[small_gpu].memory_bytes - 2**29


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="measures on a GPU here")
@pytest.mark.slow  # ~30 s
def test_tune_for_gpus_that_are_not_here_searches_the_mesh(small_gpu, tmp_path):
    out = tmp_path / "tune"
    args = ["tune", "--preset", "tiny", "--model.n_layer", "4", "--model.dropout", "0",
            "--model.tie_embeddings", "false", "--model.d_model", "512", "--model.seq_len", "512",
            "--train.batch_size", "8", "--gpu", small_gpu, "--world-size", "2",
            "--interconnect", "pcie4", "--out", str(out)]  # fmt: skip
    assert main(args) == 0
    text = (out / "tune.md").read_text()
    assert "2 x test-gpu over pcie4: predicted, not measured" in text
    assert "Fastest that fits" in text
    best = tomllib.loads((out / "best.toml").read_text())
    assert best["dist"]["strategy"] in ("fsdp", "ddp")
