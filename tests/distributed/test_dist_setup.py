"""Distributed settings without launching processes: strategy choice, refusals, the per-rank
memory arithmetic, sharded checkpoint folders, and FSDP's mixed precision on a one-process
group (gloo, in this process)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.distributed as dist

from onegpu.backends.torch import checkpoint as ckpt
from onegpu.backends.torch.build import build
from onegpu.config import ConfigError, DistConfig, load_config
from onegpu.distributed import DistContext, init_distributed
from onegpu.distributed.context import resolve_strategy
from onegpu.distributed.shares import ParamShape, per_rank_memory, shard_fraction
from onegpu.runs import checkpoints


def test_auto_is_fsdp_on_several_processes_and_nothing_on_one():
    assert resolve_strategy(DistConfig(), 1) == "none"
    assert resolve_strategy(DistConfig(), 4) == "fsdp"
    assert resolve_strategy(DistConfig(strategy="ddp"), 2) == "ddp"
    with pytest.raises(ConfigError, match="dist.strategy"):
        resolve_strategy(DistConfig(strategy="none"), 2)


def test_fsdp_outside_torchrun_says_how_to_launch(monkeypatch):
    for var in ("WORLD_SIZE", "MASTER_ADDR", "RANK"):
        monkeypatch.delenv(var, raising=False)
    with pytest.raises(ConfigError, match="torchrun --nproc-per-node"):
        init_distributed(DistConfig(strategy="fsdp"), "cpu")
    with pytest.raises(ConfigError, match="dist.backend"):
        monkeypatch.setenv("MASTER_ADDR", "localhost")
        init_distributed(DistConfig(strategy="ddp", backend="nccl"), "cpu")


def test_cpu_offload_alone_is_refused_before_anything_runs(tiny_cfg):
    cfg = load_config("tiny", overrides={"dist.cpu_offload": "true", "train.device": "cpu"})
    with pytest.raises(ConfigError, match="dist.cpu_offload"):
        build(cfg, with_data=False)


@pytest.mark.parametrize(
    ("over", "field"),
    [
        ({"train.batch_size": "6", "train.micro_batch_size": "2"}, "train.batch_size"),
        ({"train.compile": "default"}, "train.compile"),
        ({"optim.in_backward": "true", "optim.grad_clip": "0", "train.micro_batch_size": "8"},
         "optim.in_backward"),
        ({"train.precision": "fp16"}, "train.precision"),
        ({"train.precision": "bf16-pure"}, "train.precision"),
        ({"optim.name": "adafactor"}, "optim.name"),
    ],
)  # fmt: skip
def test_what_several_processes_cannot_do_is_refused(over, field):
    from onegpu.backends.torch.build import resolve
    from onegpu.config import check_distributed

    cfg = load_config("tiny", overrides={"train.device": "cpu", **over})
    resolved = resolve(cfg, torch.device("cpu")).config
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        check_distributed(resolved, "fsdp", 2)


def test_shards_follow_fsdp2s_cut_along_rows():
    p = ParamShape((10, 3), 4)  # 10 rows over 4 processes: rank 0 holds ceil(10/4) = 3 rows
    assert p.shard_numel(4) == 9 and p.shard_numel(1) == 30 and p.shard_numel(16) == 3
    assert ParamShape((), 4).shard_numel(8) == 1
    assert shard_fraction([ParamShape((8, 8), 4)], 2) == 0.5


def test_per_rank_memory_shards_states_and_offload_moves_them_to_the_host():
    single = {"params": 800, "grads": 800, "optimizer": 1600, "activations": 500, "other": 50}
    single["peak"] = sum(single.values())
    params = [ParamShape((100, 2), 4)]  # 200 parameters, all in one block
    fsdp = per_rank_memory(single, params, [200], world_size=4, strategy="fsdp",
                           gather_bytes=2)  # fmt: skip
    assert (fsdp["params"], fsdp["grads"], fsdp["optimizer"]) == (200, 200, 400)
    assert fsdp["activations"] == 500 and fsdp["host"] == 0
    assert fsdp["gathered"] == 2 * 200 * 2 + 200 * 4  # two blocks gathered, one full gradient
    assert fsdp["peak"] == 200 + 200 + 400 + 500 + 50 + fsdp["gathered"]
    off = per_rank_memory(single, params, [200], world_size=4, strategy="fsdp",
                          cpu_offload=True)  # fmt: skip
    assert off["host"] == 800 and off["params"] == off["optimizer"] == 0
    assert (
        per_rank_memory(single, params, [200], world_size=4, strategy="ddp")["peak"]
        == single["peak"]
    )


def test_a_forward_peak_holds_no_gradient_and_outside_the_blocks_only_the_roots_weights():
    """FSDP2 reshards each block after its forward, and the root keeps its weights gathered:
    at a loss's peak nothing but the root's weights is gathered; in a block, that block and
    the next one prefetched; a block's full gradient only exists in backward."""
    single = {"params": 1200, "grads": 0, "optimizer": 2400, "activations": 500, "other": 50}
    params = [ParamShape((100, 3), 4)]  # 300 parameters: a block of 200, the root's 100
    kwargs = {"world_size": 4, "strategy": "fsdp", "gather_bytes": 2, "reduce_bytes": 4}
    backward = per_rank_memory(single, params, [200], **kwargs)
    in_block = per_rank_memory(single, params, [200], peak_in_backward=False, **kwargs)
    at_loss = per_rank_memory(
        single, params, [200], peak_in_backward=False, peak_in_a_block=False, **kwargs
    )
    # in backward: a block's fp32 gradient before its reduce-scatter, the root's until the end
    assert backward["gathered"] == (100 + 2 * 200) * 2 + 200 * 4 + 100 * 2
    assert in_block["gathered"] == (100 + 2 * 200) * 2
    assert at_loss["gathered"] == 100 * 2
    kept = per_rank_memory(
        single, params, [200], peak_in_backward=False, peak_in_a_block=False,
        reshard_after_forward=False, **kwargs,
    )  # fmt: skip
    assert kept["gathered"] == (100 + 200) * 2  # every block stays gathered to its backward


def test_a_ranks_peak_is_the_most_over_the_steps_moments():
    """One process peaks at the end of backward, every gradient alive; sharded over 8, those
    gradients shrink, and the rank's peak is its forward's (the activations at the loss)."""
    from onegpu.plan.memory import MemoryPlan, Moment
    from onegpu.plan.targets import rank_memory, rank_peak

    def moment(activations: int, grads: int, in_backward: bool) -> Moment:
        memory = {"params": 800, "grads": grads, "optimizer": 1600}
        memory |= {"activations": activations, "other": 0}
        memory["peak"] = sum(memory.values())
        return Moment(memory, {}, in_backward, in_a_block=False)

    forward, backward = moment(1000, 0, False), moment(300, 800, True)
    plan = MemoryPlan(
        memory=backward.memory,
        peak_phase="backward/optimizer",
        peak_op="aten.add_",
        param_shapes=[ParamShape((200,), 4)],  # 25 rows of 200 on each of 8 ranks
        block_numels=[20] * 10,  # ten blocks of 20 weights
        segments=[forward, backward],
    )
    assert backward.memory["peak"] > forward.memory["peak"]  # one process: backward's
    rank, moment = rank_peak(DistConfig(), plan, 8, "fsdp")
    assert moment is forward and rank == rank_memory(DistConfig(), plan, 8, "fsdp")
    # rank 0 of 8 holds 1/8 of weights, gradients and states; in forward, no gradient
    assert rank["activations"] == 1000 and rank["grads"] == 0
    assert rank["gathered"] == 0  # at the loss: every block resharded, the root has none
    assert rank["peak"] == 100 + 200 + 1000
    only_backward = rank_memory(DistConfig(), dataclasses.replace(plan, segments=[]), 8, "fsdp")
    assert only_backward["peak"] < rank["peak"]  # the peak moment alone would under-plan


def test_each_stretch_of_a_followed_step_gives_its_most_and_its_most_besides_gradients():
    """A rank of FSDP shards its gradients, so its backward peaks where the step holds the
    most besides them (early in backward), not where one process's does (the end)."""
    from onegpu.plan.memory import plan_memory

    over = {"train.device": "cpu", "train.precision": "fp32", "train.batch_size": "1"}
    # wide and short: gradients outweigh activations, and backward holds the most at its end
    over |= {"train.micro_batch_size": "1", "model.d_model": "256", "model.seq_len": "16"}
    plan = plan_memory(load_config("tiny", overrides=over), by_segment=True)
    assert max(m.memory["peak"] for m in plan.segments) == plan.memory["peak"]
    pairs = list(zip(plan.segments[::2], plan.segments[1::2], strict=True))
    for most, besides in pairs:
        assert most.in_backward == besides.in_backward
        assert besides.memory["peak"] <= most.memory["peak"]
        besides_grads = besides.memory["peak"] - besides.memory["grads"]
        assert besides_grads >= most.memory["peak"] - most.memory["grads"]
    backward = [(m, b) for m, b in pairs if m.in_backward]
    assert backward and any(b.memory["grads"] < m.memory["grads"] for m, b in backward)


def test_the_gpu_plan_of_fsdp_mixed_precision_holds_no_autocast_copy_of_a_weight():
    """Under FSDP's mixed precision the gathered bf16 weights are what the matmuls read: the
    copies autocast makes otherwise (the blocks' saved for backward, the output layer's made
    and used in forward by the chunked loss) are not planned, and at the loss's peak only
    the root's weights are gathered. Measured on an H200 at GPT-2's shape: 3.87 GiB, planned
    4.06 before, 3.94 with these
    (benchmarks/results/replan-gpu-nvidia-h200-2026-11-28-2-2026-11-29-3.md)."""
    from onegpu.offload.weights import with_offload_params
    from onegpu.plan.memory import plan_memory
    from onegpu.plan.targets import gpu_caps, process_share, rank_memory

    over = {"train.device": "cuda", "train.precision": "bf16", "memory.loss_chunk": "128"}
    over |= {"model.vocab_size": "4096", "memory.offload_params": "true"}
    cfg = with_offload_params(load_config("tiny", overrides=over))  # FSDP2's CPU offload
    plan = plan_memory(process_share(cfg, 1), "cuda", gpu_caps("H200-141"))
    copies = plan.weight_copies_at_peak
    assert plan.peak_phase == "forward" and not plan.peak_in_a_block
    assert copies["activations"] > 0 and copies["other"] > 0  # the blocks', the head's
    m = cfg.model
    head = m.vocab_size * m.d_model * 2
    biases = m.n_layer * (5 + m.mlp_ratio) * m.d_model * 2  # q, k, v, proj, fc (x4), proj
    assert copies["other"] == head + biases  # cached by autocast, no backward reads them
    off = rank_memory(cfg.dist, plan, 1, "fsdp")
    assert off["activations"] == plan.memory["activations"] - copies["activations"]
    assert off["other"] == plan.memory["other"] - head - biases
    root = sum(p.numel for p in plan.param_shapes) - sum(plan.block_numels)
    assert off["gathered"] == root * 2


def test_only_complete_sharded_folders_count_and_leftovers_go(tmp_path):
    whole = tmp_path / ckpt.checkpoint_name(4, sharded=True)
    whole.mkdir()
    (whole / ".metadata").write_bytes(b"x")
    (whole / ckpt.TRAIN_STATE).write_bytes(b"x")
    half = tmp_path / ckpt.checkpoint_name(6, sharded=True)  # no train_state.pt: not complete
    half.mkdir()
    (half / ".metadata").write_bytes(b"x")
    killed = tmp_path / (checkpoints.TMP_PREFIX + ckpt.checkpoint_name(8, sharded=True))
    killed.mkdir()
    (killed / "__0_0.distcp").write_bytes(b"x")
    assert [s for s, _ in checkpoints.complete_checkpoints(tmp_path)] == [4]
    assert checkpoints.remove_partial(tmp_path) == [killed] and not killed.exists()
    with pytest.raises(ConfigError, match="not a complete sharded checkpoint"):
        ckpt.load(half)


@pytest.mark.parametrize("flat", [True, False], ids=["per-parameter", "written-unflattened"])
def test_a_sharded_checkpoint_loads_per_parameter_and_in_the_older_format(tmp_path, flat):
    """Optimizer state is written one key per parameter (a pipeline stage's groups stay its
    own); folders written before that, with one `param_groups` list, still load."""
    import torch.distributed.checkpoint as torch_dcp

    from onegpu.distributed import dcp

    def made(lr: float) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
        return model, torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.8, 0.9))

    model, optimizer = made(1e-2)
    model(torch.randn(3, 4)).sum().backward()
    optimizer.step()
    torch_dcp.save(dcp._state(model, optimizer, flat), checkpoint_id=str(tmp_path))
    written = torch_dcp.FileSystemReader(str(tmp_path)).read_metadata().state_dict_metadata
    assert ("optimizer.param_groups.0.weight.lr" in written) is flat
    loaded_model, loaded = made(5.0)
    dcp.load(tmp_path, loaded_model, loaded)
    assert loaded.param_groups[0]["lr"] == 1e-2 and loaded.param_groups[0]["betas"] == (0.8, 0.9)
    for a, b in zip(model.parameters(), loaded_model.parameters(), strict=True):
        assert torch.equal(a, b)
        assert torch.equal(optimizer.state[a]["exp_avg_sq"], loaded.state[b]["exp_avg_sq"])


@pytest.fixture
def one_process_group():
    """A real gloo process group of one process, in this process."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield DistContext(strategy="fsdp", world_size=1, backend="gloo")
    dist.destroy_process_group()


def test_fsdp_mixed_precision_casts_gathered_weights_once_not_per_op(one_process_group):
    """Under FSDP with bf16, a block computes with bf16 parameters (cast once when gathered),
    while the sharded master weights and their gradients stay fp32; autocast alone keeps fp32
    parameters and casts inside each op. Same loss to bf16 rounding."""
    over = {"train.device": "cpu", "train.precision": "bf16", "train.batch_size": "4",
            "train.micro_batch_size": "4"}  # fmt: skip
    x = torch.randint(0, 256, (4, 64))
    seen: dict[str, torch.dtype] = {}

    def run(ctx):
        built = build(load_config("tiny", overrides=over), with_data=False, dist_ctx=ctx)
        fc = built.model.blocks[0].mlp.fc
        handle = fc.register_forward_pre_hook(
            lambda m, args: seen.__setitem__(ctx.strategy if ctx else "none", m.weight.dtype)
        )
        built.step.forward_backward(x, x, x.numel())
        handle.remove()
        return built

    sharded = run(one_process_group)
    plain = run(None)
    assert seen == {"fsdp": torch.bfloat16, "none": torch.float32}
    w = sharded.model.blocks[0].mlp.fc.weight
    assert type(w).__name__ == "DTensor" and w.dtype == torch.float32
    assert w.grad is not None and w.grad.dtype == torch.float32
    g_fsdp = w.grad.full_tensor()
    g_plain = plain.model.blocks[0].mlp.fc.weight.grad
    assert torch.nn.functional.cosine_similarity(g_fsdp.flatten(), g_plain.flatten(), dim=0) > 0.99


def test_plan_per_process_halves_the_states_and_counts_the_gpus_needed():
    from onegpu.plan.report import plan_report

    cfg = load_config("tiny", overrides={"train.device": "cpu", "train.micro_batch_size": "2"})
    one = plan_report(cfg, None, None)["memory"]
    two = plan_report(cfg, "A100-40", None, world_size=2)
    assert two["memory"]["optimizer"] == pytest.approx(one["optimizer"] / 2, rel=0.01)
    assert two["dist"]["strategy"] == "fsdp" and two["memory"]["gathered"] > 0
    rows = two["gpus_needed"]["rows"]
    assert [r["world_size"] for r in rows] == [1, 2, 4]  # batch 8 / micro 2 splits up to 4
    assert two["gpus_needed"]["fewest"] == 1
    with pytest.raises(ConfigError, match="train.batch_size"):
        plan_report(cfg, None, None, world_size=3)
