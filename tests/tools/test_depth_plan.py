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
    assert fast.offloaded_per_micro_batch == full.offloaded_per_micro_batch
    assert sum(s.numel for s in fast.param_shapes) == sum(s.numel for s in full.param_shapes)


def test_shallow_depths_are_whole_periods_of_the_checkpointing_policy():
    cfg = load_config("tiny", overrides={"memory.checkpointing": "every:3"})
    assert shallow_depths(cfg.memory) == (6, 9)
    assert shallow_depths(load_config("tiny").memory) == (2, 3)


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
