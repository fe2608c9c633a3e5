"""Tensor parallelism of `--model.hf` models from their config's `base_model_tp_plan`
(distributed/hf_tensor_parallel.py): two processes under torchrun with gloo equal one process,
fp32, 1e-5 relative, on architectures whose plans name different layers; what cannot be split is
refused by name before anything runs."""

from __future__ import annotations

import pytest
import torch
from conftest import make_hf_config
from launching import launch, losses
from safetensors.torch import load_file
from test_parallel_layouts import REL, assert_close_losses

from onegpu.config import ConfigError
from onegpu.distributed.hf_tensor_parallel import hf_tp_plan

RUN = {
    "model.seq_len": 32,
    "train.max_steps": 10,
    "train.batch_size": 8,
    "train.micro_batch_size": 4,
    "checkpoint.every": 5,
}


def _folder(tmp_path, arch: str, **changes):
    import transformers

    cfg = make_hf_config(arch)
    for key, value in changes.items():
        setattr(cfg, key, value)
    torch.manual_seed(1)
    transformers.AutoModelForCausalLM.from_config(cfg).save_pretrained(tmp_path / arch)
    return tmp_path / arch


@pytest.mark.slow  # two launches per architecture (~40 s each)
@pytest.mark.parametrize(
    ("arch", "changes", "over"),
    [
        ("llama", {}, {}),  # grouped key-value heads, an untied output layer
        # q/k/v biases, a tied embedding split by vocabulary rows once for both, the chunked
        # loss on each process's columns
        ("qwen2", {"tie_word_embeddings": True}, {"memory.loss_chunk": 16}),
        ("phi", {}, {}),  # LayerNorms with biases, `dense` / `fc1` / `fc2` in its plan
        # 2-D: FSDP2 over the other dimension, with block checkpointing (4 processes)
        ("llama", {}, {"dist.dp_shard": 2, "memory.checkpointing": "block"}),
    ],
    ids=["llama", "qwen2-tied-chunked", "phi", "llama-tp2xfsdp2-block"],
)
def test_tensor_parallel_hf_model_equals_one_process(tmp_path, arch, changes, over):
    folder = _folder(tmp_path, arch, **changes)
    values = {**RUN, **over, "model.hf": str(folder)}
    single = {k: v for k, v in values.items() if not k.startswith("dist.")}
    launch(tmp_path / "one", 1, **single)
    launch(tmp_path / "tp", 2 * int(over.get("dist.dp_shard", 1)), **values, **{"dist.tp": 2})
    assert_close_losses(losses(tmp_path / "tp"), losses(tmp_path / "one"))
    _assert_same_weights(tmp_path / "tp", tmp_path / "one")


def _assert_same_weights(a, b) -> None:
    """Final weights to 1e-5 relative, but the key biases: their gradient is zero by math (a
    bias on every key shifts a query's scores alike), so AdamW turns rounding noise into
    learning-rate-sized steps that differ with the reduction order."""
    wa, wb = load_file(a / "model.safetensors"), load_file(b / "model.safetensors")
    assert wa.keys() == wb.keys()
    for name, t in wb.items():
        if not name.endswith("k_proj.bias"):
            assert (wa[name] - t).norm() <= REL * t.norm(), name


def _meta_model(arch: str, **changes):
    import transformers

    cfg = make_hf_config(arch) if arch != "mixtral" else transformers.MixtralConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=320, num_local_experts=2,
    )  # fmt: skip
    for key, value in changes.items():
        setattr(cfg, key, value)
    with torch.device("meta"):
        return transformers.AutoModelForCausalLM.from_config(cfg)


@pytest.mark.parametrize(
    ("arch", "tp", "changes", "says"),
    [
        ("gpt2", 2, {}, "no tensor-parallel plan"),
        # Mixtral's plan split its experts with this style up to transformers 5.2x; it is
        # named here so the refusal is tested whatever the installed version's plan says
        (
            "mixtral",
            2,
            {"base_model_tp_plan": {"layers.*.mlp.experts": "moe_tp_experts"}},
            "moe_tp_experts",
        ),
        ("llama", 3, {}, "attention heads"),
        ("llama", 4, {}, "key-value heads"),
        ("llama", 2, {"vocab_size": 321}, "vocabulary"),
    ],
)
def test_what_an_hf_model_cannot_split_is_refused_by_name(arch, tp, changes, says):
    with pytest.raises(ConfigError) as e:
        hf_tp_plan(_meta_model(arch, **changes), tp)
    assert e.value.field_name == "dist.tp" and says in str(e.value)


def test_a_plan_of_column_and_row_splits_is_taken_as_transformers_gives_it():
    plan = hf_tp_plan(_meta_model("llama"), 2)
    assert plan["layers.*.self_attn.q_proj"] == "colwise"
    assert plan["layers.*.mlp.down_proj"] == "rowwise"
