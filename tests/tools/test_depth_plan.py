"""Plans extrapolated in depth from two shallow copies equal the full plan; reshaped models are
the shapes asked for."""

import pytest

from onegpu.config import load_config
from onegpu.plan.depth import plan_extrapolated, shallow_depths
from onegpu.plan.memory import plan_memory
from onegpu.plan.shapes import Shape, ladder, scaled, shape_of, with_depth, with_shape
from onegpu.plan.targets import gpu_caps

CONFIGS = {
    "plain": {},
    "block checkpointing": {"memory.checkpointing": "block"},
    "every:2": {"memory.checkpointing": "every:2"},
    "selective, accumulated": {
        "memory.checkpointing": "selective",
        "train.batch_size": "8",
        "train.micro_batch_size": "2",
    },  # fmt: skip
    "bf16-pure sgd": {"train.precision": "bf16-pure", "optim.name": "sgd"},
    "optimizer on the host": {"memory.offload_optimizer": "true"},
    "activations on the host": {"memory.offload_activations": "true"},
}


# the default suite keeps a few; the rest run in the slow suite (the default stays < 5 min)
SLOW = {"every:2", "selective, accumulated", "bf16-pure sgd"}
CASES = [pytest.param(over, "cuda", id=f"{name}, GPU plan",
                      marks=[pytest.mark.slow] if name in SLOW else [])
         for name, over in CONFIGS.items()]  # fmt: skip
CASES.append(pytest.param({}, "cpu", id="plain, CPU plan", marks=pytest.mark.slow))


@pytest.mark.parametrize(("over", "target"), CASES)
def test_a_plan_extrapolated_in_depth_equals_the_full_plan(over, target):
    """Eight blocks from two and three (four and six for every:2): every figure of the
    breakdown, the host bytes and the counted work, to the byte."""
    cfg = load_config("tiny", overrides={"train.device": "cpu", "model.n_layer": "8",
                                         "model.dropout": "0.0", **over})  # fmt: skip
    caps = gpu_caps("A100-40") if target == "cuda" else None
    full = plan_memory(cfg, target, caps)
    fast = plan_extrapolated(cfg, target, caps)
    assert fast.memory == full.memory
    assert (fast.n_params, fast.flops_per_token) == (full.n_params, full.flops_per_token)
    assert fast.dispatched_ops == full.dispatched_ops  # each block launches its own ops
    assert fast.offloaded_per_micro_batch == full.offloaded_per_micro_batch
    assert sum(s.numel for s in fast.param_shapes) == sum(s.numel for s in full.param_shapes)


def test_shallow_depths_are_whole_periods_of_the_checkpointing_policy():
    cfg = load_config("tiny", overrides={"memory.checkpointing": "every:3"})
    assert shallow_depths(cfg) == (6, 9)
    assert shallow_depths(load_config("tiny")) == (2, 3)


def test_a_reshaped_hf_folder_has_the_shape_asked_for(hf_folder):
    cfg = load_config(overrides={"model.hf": str(hf_folder("llama", weights=False)),
                                 "model.seq_len": "32"})  # fmt: skip
    base = shape_of(cfg)
    assert base == Shape(n_layer=2, d_model=64, n_head=4, n_kv_head=2, d_ff=128)
    bigger = Shape(n_layer=5, d_model=128, n_head=8, n_kv_head=2, d_ff=256)
    assert shape_of(with_shape(cfg, bigger)) == bigger
    assert shape_of(with_depth(cfg, 7)).n_layer == 7
    plan = plan_memory(with_shape(cfg, bigger))
    assert plan.n_params > plan_memory(cfg).n_params


def test_a_family_grows_in_width_and_depth_keeping_heads_and_kv_groups():
    llama_8b = Shape(n_layer=32, d_model=4096, n_head=32, n_kv_head=8, d_ff=14336)
    sizes = ladder(llama_8b)
    assert llama_8b in sizes
    params = [s.n_layer * s.d_model * (2 * s.d_model + 3 * s.d_ff) for s in sizes]
    assert params == sorted(params)
    for s in sizes:
        assert s.head_dim == 128 and s.d_model % s.n_head == 0
        assert s.n_kv_head == 8 or s.n_kv_head == s.n_head  # Llama keeps 8 kv heads
    # 70B's shape is on the ladder's path: twice the width, 2.5 times the depth
    assert scaled(llama_8b, 2.0).d_model == 8192
    gpt2 = Shape(n_layer=12, d_model=768, n_head=12, n_kv_head=12, d_ff=3072)
    assert all(s.d_ff == 4 * s.d_model for s in ladder(gpt2, 2, 2))


def _hf_cfg(tmp_path, config) -> object:
    config.save_pretrained(tmp_path / "model")
    return load_config(overrides={"model.hf": str(tmp_path / "model"), "model.seq_len": "32",
                                  "train.device": "cpu", "train.precision": "fp32",
                                  "train.batch_size": "2", "train.micro_batch_size": "2"})  # fmt: skip


def test_a_copy_in_depth_keeps_its_per_layer_lists_valid(tmp_path):
    """transformers checks `layer_types` against the depth (a copy of 2 blocks keeping 26
    entries was refused): per-layer lists are cut to the copy's depth (repeated where it is
    deeper), lists of layer numbers keep the copy's layers; the head size is the config's."""
    import transformers

    from onegpu.plan.shapes import _hf_config

    types = ["full_attention", "sliding_attention", "sliding_attention"] * 2
    cfg = _hf_cfg(tmp_path, transformers.Qwen2MoeConfig(
        vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=6,
        num_attention_heads=4, num_key_value_heads=2, num_experts=4, num_experts_per_tok=2,
        moe_intermediate_size=32, shared_expert_intermediate_size=64, mlp_only_layers=[0, 4],
        layer_types=types, use_sliding_window=True, sliding_window=16, head_dim=32,
    ))  # fmt: skip
    two, nine = _hf_config(with_depth(cfg, 2).model), _hf_config(with_depth(cfg, 9).model)
    assert (two.num_hidden_layers, two.layer_types, two.mlp_only_layers) == (2, types[:2], [0])
    assert nine.layer_types == types + types[:3] and nine.mlp_only_layers == [0, 4]
    assert two.head_dim == 32  # not hidden / heads (16)
    assert plan_memory(with_depth(cfg, 2)).memory["peak"] > 0


@pytest.mark.slow  # plans real-width MoE copies
def test_the_shallow_copies_start_past_the_leading_dense_blocks(tmp_path):
    """DeepSeek-V3 builds its first three blocks dense: copies of two and three blocks hold no
    experts, and the extrapolated model had 37B of V3's 671B parameters. The copies now start
    past them, and the fast plan equals the full one."""
    import transformers

    cfg = _hf_cfg(tmp_path, transformers.DeepseekV3Config(
        vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=9,
        num_attention_heads=4, num_key_value_heads=4, n_routed_experts=4, num_experts_per_tok=2,
        moe_intermediate_size=48, n_group=1, topk_group=1, first_k_dense_replace=3,
        q_lora_rank=None, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8,
        v_head_dim=16,
    ))  # fmt: skip
    assert shallow_depths(cfg) == (5, 6)
    full, fast = plan_memory(cfg), plan_extrapolated(cfg)
    assert fast.n_params == full.n_params
    assert fast.memory["peak"] == pytest.approx(full.memory["peak"], rel=1e-3)
