"""The device mesh from `[dist]`: its shape, and every bad input refused in one line naming the
field, exit 2, before any process group exists."""

from __future__ import annotations

import subprocess
import sys

import pytest

from onegpu.config import ConfigError, load_config, resolve_strategy
from onegpu.config.layout import Layout, resolve_layout
from onegpu.distributed.context import DistContext
from onegpu.distributed.pipeline import split_blocks, stage_indices


def _dist(**over):
    return load_config("tiny", overrides={k: str(v) for k, v in over.items()}).dist


@pytest.mark.parametrize(
    ("over", "world", "layout"),
    [
        ({}, 4, Layout(dp_shard=4)),
        ({"dist.strategy": "ddp"}, 4, Layout(dp_replicate=4)),
        ({"dist.tp": 2}, 4, Layout(dp_shard=2, tp=2)),
        ({"dist.dp_replicate": 2}, 8, Layout(dp_replicate=2, dp_shard=4)),
        ({"dist.pp": 2, "model.tie_embeddings": "false"}, 8, Layout(dp_shard=4, pp=2)),
        ({"dist.tp": 2, "dist.dp_shard": 1}, 2, Layout(tp=2)),
    ],
)
def test_dp_shard_takes_the_processes_the_other_dimensions_leave(over, world, layout):
    assert resolve_layout(_dist(**over), world) == layout


def test_ranks_are_laid_out_tp_innermost_and_rows_follow_the_data_parallel_rank():
    layout = Layout(dp_replicate=2, dp_shard=2, tp=2, pp=2)  # 16 processes
    coords = []
    for rank in range(16):
        ctx = DistContext(strategy="fsdp", rank=rank, world_size=16, layout=layout)
        coords.append((ctx.coordinate("pp"), ctx.dp_rank, ctx.coordinate("tp")))
    assert coords[:4] == [(0, 0, 0), (0, 0, 1), (0, 1, 0), (0, 1, 1)]
    assert coords[8] == (1, 0, 0)
    # the two tensor-parallel processes of a data-parallel rank take the same rows
    a, b = (DistContext(strategy="fsdp", rank=r, world_size=16, layout=layout) for r in (2, 3))
    assert a.rows(32) == b.rows(32) == slice(8, 16)


def test_dropout_streams_differ_across_tensor_and_pipeline_ranks_not_data_parallel_ones():
    layout = Layout(dp_replicate=1, dp_shard=2, tp=2, pp=2)  # 8 processes
    streams = {}
    for rank in range(8):
        ctx = DistContext(strategy="fsdp", rank=rank, world_size=8, layout=layout)
        streams.setdefault(ctx.random_stream, set()).add(ctx.dp_rank)
    # four (stage, tp rank) pairs, each shared by the two processes that split the batch
    assert sorted(streams) == [0, 1, 2, 3]
    assert all(ranks == {0, 1} for ranks in streams.values())
    assert DistContext(strategy="fsdp", world_size=2, layout=Layout(dp_shard=2)).random_stream == 0


@pytest.mark.parametrize(
    ("over", "world", "field"),
    [
        ({"dist.tp": 2, "dist.dp_shard": 3}, 4, "dist.dp_replicate x dp_shard x tp x pp"),
        ({"dist.tp": 2}, 1, "dist.dp_replicate x dp_shard x tp x pp"),
        ({"dist.strategy": "ddp", "dist.tp": 2}, 4, "dist.strategy"),
        ({"dist.strategy": "ddp", "dist.dp_shard": 2}, 4, "dist.dp_shard"),
    ],
)
def test_a_mesh_that_does_not_fit_the_processes_is_refused(over, world, field):
    with pytest.raises(ConfigError) as e:
        resolve_strategy(_dist(**over), world)
    assert e.value.field_name == field


@pytest.mark.parametrize(
    ("over", "field", "says"),
    [
        ({"dist.tp": 3}, "dist.tp", "heads"),
        ({"dist.tp": 4, "model.n_head": 8, "model.vocab_size": 258, "model.pad_vocab_to": 2},
         "dist.tp", "vocabulary"),
        ({"dist.pp": 3}, "dist.pp", "blocks"),
        ({"dist.pp": 2, "model.n_layer": 2, "model.tie_embeddings": "false",
          "dist.pp_schedule": "interleaved-1f1b"}, "dist.pp", "stages"),
        ({"dist.pp": 2}, "model.tie_embeddings", "first pipeline stage"),
        ({"dist.pp_schedule": "zb"}, "dist.pp_schedule", "1f1b"),
        ({"dist.grad_compression": "powersgd:4"}, "dist.grad_compression", "strategy ddp"),
        ({"dist.grad_compression": "powersgd:0", "dist.strategy": "ddp"},
         "dist.grad_compression", "powersgd:RANK"),
        ({"dist.tp": 2, "memory.gelu_bits": 2}, "memory.gelu_bits", "tensor parallelism"),
        ({"dist.tp": 0}, "dist.tp", "at least 1"),
    ],
)  # fmt: skip
def test_what_a_layout_cannot_do_is_refused_when_the_config_loads(over, field, says):
    with pytest.raises(ConfigError) as e:
        load_config("tiny", overrides={k: str(v) for k, v in over.items()})
    assert e.value.field_name == field and says in str(e.value)


def test_the_command_line_says_it_in_one_line_and_exits_2(tmp_path):
    """Outside torchrun, `--dist.tp 2` is a mesh of 2 for 1 process: refused before any
    process group, nothing written."""
    out = tmp_path / "run"
    proc = subprocess.run(
        [sys.executable, "-m", "onegpu", "train", "--preset", "tiny", "--dist.tp", "2",
         "--out.dir", str(out)],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "torchrun --nproc-per-node 2" in lines[0], proc.stderr
    assert not out.exists()


def test_stages_are_cut_by_cost_the_output_layer_weighs_on_the_last():
    """A large vocabulary makes the output layer worth blocks: the last stage gets fewer."""
    m = load_config("tiny", overrides={"model.n_layer": "8", "model.vocab_size": "8192"}).model
    ranges = split_blocks(m, 64, 2)
    assert ranges[0].start == 0 and ranges[-1].stop == 8
    assert len(ranges[-1]) < len(ranges[0])
    even = load_config("tiny", overrides={"model.n_layer": "8"}).model
    assert [len(r) for r in split_blocks(even, 64, 2)] == [4, 4]
    assert stage_indices(1, 2, "interleaved-1f1b") == [1, 3]


def test_the_jax_backend_refuses_a_mesh_in_one_line():
    with pytest.raises(ConfigError) as e:
        load_config("tiny", overrides={"train.backend": "jax", "dist.tp": "2"})
    assert e.value.field_name == "dist.tp" and "one process" in str(e.value)


def test_a_pipeline_of_a_hugging_face_model_is_refused_and_says_so():
    with pytest.raises(ConfigError) as e:
        load_config(None, overrides={"model.hf": "llama-3-8b", "dist.pp": "2"})
    assert e.value.field_name == "dist.pp" and "Hugging Face" in str(e.value)


@pytest.mark.parametrize(
    ("over", "world", "says"),
    [
        ({"dist.pp": 2, "dist.dp_shard": 2}, 4, "at least 2 micro-batches"),
        ({"dist.pp": 2, "train.batch_size": 16, "dist.pp_microbatches": 3}, 2, "do not split"),
        ({"dist.pp": 2, "train.batch_size": 12, "model.n_layer": 4,
          "dist.pp_schedule": "interleaved-1f1b"}, 2, "rounds of 2"),
    ],
)  # fmt: skip
def test_a_pipeline_without_enough_micro_batches_is_refused_before_it_starts(over, world, says):
    from onegpu.config import check_distributed

    over = {"model.tie_embeddings": "false", **over}
    cfg = load_config("tiny", overrides={k: str(v) for k, v in over.items()})
    with pytest.raises(ConfigError, match=says):
        check_distributed(cfg, resolve_strategy(cfg.dist, world), world)
