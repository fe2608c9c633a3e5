"""Tensor, pipeline and 2-D parallelism and compressed gradients equal one process.

Every run is `onegpu train` under `python -m torch.distributed.run` with gloo on this CPU, as
a user launches it, fp32 and no dropout. Two models: the `tiny` preset with a padded vocabulary
(tied embeddings: tensor parallelism's vocabulary-sharded embedding and output layer share one
weight, and its padding columns are masked per shard) and a 4-block untied one for pipelines
(interleaving needs 2 stages per process). 1e-5 relative (reduction order), as the issue asks.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from launching import launch, losses
from safetensors.torch import load_file

from onegpu.backends.torch import checkpoint as ckpt
from onegpu.config import load_config

pytestmark = pytest.mark.slow

STEPS = 10
REL = 1e-5
TIED = {
    "train.max_steps": STEPS,
    "train.batch_size": 16,
    "train.micro_batch_size": 4,
    "model.pad_vocab_to": 96,  # 256 -> 288 columns: the padding is masked on its shard
    "checkpoint.every": 5,
    # pinned: a TP run times its attention at 1/tp of the heads, one process at all of them,
    # and SDPA against plain moves the weights past REL (plain: TP may not recompute SDPA)
    "model.attention": "plain",
}
UNTIED = {**TIED, "model.tie_embeddings": "false", "model.n_layer": 4, "model.bias": "false"}


def assert_close_losses(a: dict[int, float], b: dict[int, float], rel: float = REL) -> float:
    """Same steps, each loss within `rel`; the largest relative difference."""
    assert a.keys() == b.keys() and len(a) >= STEPS, (a, b)
    worst = max(abs(a[s] - b[s]) / abs(b[s]) for s in a)
    assert worst <= rel, (worst, a, b)
    return worst


def assert_same_weights(a: Path, b: Path) -> None:
    """Final weights to 1e-5 relative; the key biases, whose gradient is zero by math and so
    pure rounding noise that AdamW scales up, to 1e-5 absolute."""
    wa, wb = load_file(a / "model.safetensors"), load_file(b / "model.safetensors")
    assert wa.keys() == wb.keys()
    for name, t in wb.items():
        assert (wa[name] - t).norm() <= REL * t.norm() + REL, name


# name: (processes, config overrides)
LAYOUTS = {
    "single": (1, TIED),
    "tp": (2, {**TIED, "dist.tp": 2}),
    "tp_chunked": (2, {**TIED, "dist.tp": 2, "memory.loss_chunk": 16}),
    "tp_fsdp": (4, {**TIED, "dist.tp": 2, "dist.dp_shard": 2}),
    "hsdp": (4, {**TIED, "dist.dp_replicate": 2, "dist.dp_shard": 2}),
    "single_untied": (1, UNTIED),
    "pp_1f1b": (2, {**UNTIED, "dist.pp": 2}),
    "pp_gpipe": (2, {**UNTIED, "dist.pp": 2, "dist.pp_schedule": "gpipe"}),
    "pp_interleaved": (2, {**UNTIED, "dist.pp": 2, "dist.pp_schedule": "interleaved-1f1b"}),
    "pp_fsdp": (4, {**UNTIED, "dist.pp": 2, "dist.dp_shard": 2}),
    # each stage's blocks split over 2 processes; sequence-parallel activations between stages
    "tp_pp": (4, {**UNTIED, "dist.tp": 2, "dist.pp": 2}),
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("layouts")
    for name, (nproc, over) in LAYOUTS.items():
        launch(root / name, nproc, **over)
    return {name: root / name for name in LAYOUTS}


@pytest.mark.parametrize(
    ("layout", "reference"),
    [
        ("tp", "single"),
        ("tp_chunked", "single"),
        ("tp_fsdp", "single"),
        ("hsdp", "single"),
        ("pp_1f1b", "single_untied"),
        ("pp_gpipe", "single_untied"),
        ("pp_interleaved", "single_untied"),
        ("pp_fsdp", "single_untied"),
        ("tp_pp", "single_untied"),
    ],
)
def test_every_layout_equals_one_process(runs, layout, reference):
    assert_close_losses(losses(runs[layout]), losses(runs[reference]))
    assert_same_weights(runs[layout], runs[reference])
    summary = json.loads((runs[layout] / "summary.json").read_text())
    assert summary["val_loss"] == pytest.approx(
        json.loads((runs[reference] / "summary.json").read_text())["val_loss"], rel=REL
    )


def test_the_mesh_is_recorded_and_each_rank_holds_its_share(runs):
    d = json.loads((runs["tp_fsdp"] / "summary.json").read_text())["dist"]
    assert d["layout"] == {"pp": 1, "dp_replicate": 1, "dp_shard": 2, "tp": 2}
    single = json.loads((runs["single"] / "summary.json").read_text())
    whole = single["params"]
    # 4-way split weights (tp x fsdp) and norms split by FSDP only: close to a quarter
    for r in d["per_rank"]:
        assert r["param_bytes"] <= whole * 4 / 3.5


def test_a_tensor_parallel_run_resumes_exactly_and_at_other_layouts(runs, tmp_path):
    """TP 2's step-5 checkpoint: on TP 2 bit for bit; on FSDP 2 and on one process to 1e-6."""
    folder = runs["tp"] / "checkpoints" / ckpt.checkpoint_name(5, sharded=True)
    after = {s: v for s, v in losses(runs["tp"]).items() if s > 5}
    launch(tmp_path / "tp", 2, **{**TIED, "dist.tp": 2, "train.resume": str(folder)})
    assert losses(tmp_path / "tp") == after
    launch(tmp_path / "fsdp", 2, **{**TIED, "dist.strategy": "fsdp", "train.resume": str(folder)})
    launch(tmp_path / "one", 1, **{**TIED, "train.resume": str(folder)})
    for other in ("fsdp", "one"):
        resumed = losses(tmp_path / other)
        assert resumed.keys() == after.keys()
        assert max(abs(resumed[s] - after[s]) / after[s] for s in after) <= 1e-6


@pytest.mark.parametrize(
    "layout", ["tp_fsdp", "hsdp", "tp_pp", "pp_1f1b", "pp_interleaved", "pp_fsdp"]
)
def test_a_layout_resumes_bit_for_bit_on_itself(runs, tmp_path, layout):
    """Each process reloads its own shards of the step-5 checkpoint and continues on the same
    losses; in a pipeline each stage's processes hold other parameter groups (written one key
    per parameter, so no stage reads another's)."""
    nproc, over = LAYOUTS[layout]
    folder = runs[layout] / "checkpoints" / ckpt.checkpoint_name(5, sharded=True)
    launch(tmp_path / layout, nproc, **over, **{"train.resume": str(folder)})
    assert losses(tmp_path / layout) == {s: v for s, v in losses(runs[layout]).items() if s > 5}


def test_tensor_parallel_composes_with_regional_compile_bf16_and_checkpointing(tmp_path):
    """TP 2 with each block compiled on its own, bf16 autocast and block checkpointing: the
    same losses as one process with the same settings, to bf16's rounding. Its attention is
    `auto`, which here must leave SDPA's fused kernel out (torch cannot recompute it in this
    graph: techniques.attention.sdpa_recompute_fails); the one process runs the kernel the TP
    run took."""
    over = {**TIED, "train.max_steps": 4, "checkpoint.every": 0, "train.compile": "regional",
            "train.precision": "bf16", "memory.checkpointing": "block"}  # fmt: skip
    launch(tmp_path / "tp", 2, **{**over, "dist.tp": 2, "model.attention": "auto"})
    taken = load_config(file=tmp_path / "tp" / "config.toml").model.attention
    assert taken in ("plain", "blocked")
    launch(tmp_path / "one", 1, **{**over, "model.attention": taken})
    tp, one = losses(tmp_path / "tp"), losses(tmp_path / "one")
    assert tp.keys() == one.keys() == {1, 2, 3, 4}
    assert max(abs(tp[s] - one[s]) / one[s] for s in one) <= 1e-4
    assert json.loads((tmp_path / "tp" / "summary.json").read_text())["compile_time_s"] > 0


def test_dropout_draws_its_own_masks_per_tensor_parallel_rank_and_resumes_exactly(tmp_path):
    """Under TP each process holds other positions and heads of one activation: its dropout
    generator runs on a stream of its own (else both would drop the same pattern at different
    places); each stream is checkpointed and continues on resume, bit for bit."""
    over = {**TIED, "dist.tp": 2, "model.dropout": 0.2}
    launch(tmp_path / "full", 2, **over)
    folder = tmp_path / "full" / "checkpoints" / ckpt.checkpoint_name(5, sharded=True)
    first, second = (state["torch"] for state in ckpt.load(folder).state["rng"])
    assert not torch.equal(first, second)
    launch(tmp_path / "resumed", 2, **over, **{"train.resume": str(folder)})
    full = losses(tmp_path / "full")
    assert losses(tmp_path / "resumed") == {s: v for s, v in full.items() if s > 5}


def _export_newest_shards(run_dir: Path, tmp_path: Path) -> Path:
    """`onegpu export` of a copy of the run without its model.safetensors: export then reads
    the newest sharded (DCP) checkpoint. The exported folder."""
    run = tmp_path / "exported-run"
    shutil.copytree(run_dir, run)
    (run / "model.safetensors").unlink()
    out = tmp_path / "hf"
    subprocess.run(
        [sys.executable, "-m", "onegpu", "export", str(run), "--out", str(out)],
        check=True, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    return out


def test_a_pipeline_resumes_on_one_process_and_exports(runs, tmp_path):
    """PP 2 x FSDP 2's checkpoint (each stage's processes wrote their own weights): resumed on
    one process, and `onegpu export` of the run makes the one process's weights."""
    folder = runs["pp_fsdp"] / "checkpoints" / ckpt.checkpoint_name(5, sharded=True)
    launch(tmp_path / "one", 1, **{**UNTIED, "train.resume": str(folder)})
    after = {s: v for s, v in losses(runs["pp_fsdp"]).items() if s > 5}
    resumed = losses(tmp_path / "one")
    assert resumed.keys() == after.keys()
    assert max(abs(resumed[s] - after[s]) / after[s] for s in after) <= 1e-6
    out = _export_newest_shards(runs["pp_fsdp"], tmp_path)
    assert (out / "config.json").is_file()


@pytest.mark.parametrize("layout", ["tp", "tp_pp"])
def test_export_from_a_split_model_gives_the_runs_model(runs, tmp_path, layout):
    """`onegpu export` of a run whose newest weights are DCP shards (each process's piece of
    the vocabulary-split embedding, or of its stage): transformers' model from the folder
    computes the run's final model's logits."""
    import transformers

    from onegpu.tools.trained import load_trained

    out = _export_newest_shards(runs[layout], tmp_path)
    x = torch.randint(0, 256, (2, 32))
    hf = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    final = load_trained(str(runs[layout])).model.eval()  # the run's own model.safetensors
    with torch.no_grad():
        ours = final(x)[..., :256]
        theirs = hf(x).logits[..., :256]
    torch.testing.assert_close(theirs, ours, rtol=1e-5, atol=1e-5)


def test_powersgd_sends_less_and_resumes_exactly(tmp_path):
    """DDP with PowerSGD rank 2: its factors are a fraction of the gradients' bytes; a run
    resumed from step 5 continues with the same error feedback and warm start, bit for bit."""
    over = {**TIED, "dist.strategy": "ddp", "dist.grad_compression": "powersgd:2"}
    launch(tmp_path / "full", 2, **over)
    d = json.loads((tmp_path / "full" / "summary.json").read_text())["dist"]
    assert d["allreduce_bytes_per_step"] < d["uncompressed_bytes_per_step"] / 4
    folder = tmp_path / "full" / "checkpoints" / ckpt.checkpoint_name(5, sharded=True)
    launch(tmp_path / "resumed", 2, **over, **{"train.resume": str(folder)})
    full = losses(tmp_path / "full")
    assert losses(tmp_path / "resumed") == {s: v for s, v in full.items() if s > 5}


@pytest.mark.parametrize("kind", ["bf16", "fp16"])
def test_half_precision_all_reduce_stays_close(runs, tmp_path, kind):
    over = {**TIED, "dist.strategy": "ddp", "dist.grad_compression": kind}
    launch(tmp_path / kind, 2, **over)
    # 16-bit sums of gradients: close to the exact run, not equal to it
    assert_close_losses(losses(tmp_path / kind), losses(runs["single"]), rel=1e-2)
    assert torch.isfinite(torch.tensor(list(losses(tmp_path / kind).values()))).all()
