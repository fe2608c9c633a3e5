"""The planner on transformers models: saved bytes exact and the peak within 5% of a real
step, for each architecture tested, with the planner's fake build of the folder's config."""

import json

import pytest
from conftest import HF_ARCHS, hf_overrides

from onegpu.backends.torch.step_memory import measure_real_step
from onegpu.config import load_config
from onegpu.plan.fixes import planned
from onegpu.plan.memory import plan_memory


def _cfg(folder, **over):
    return load_config("tiny", overrides=hf_overrides(folder, seq_len=64, **over))


@pytest.mark.parametrize("arch", HF_ARCHS)
def test_plan_equals_a_real_step(arch, hf_folder):
    cfg = _cfg(hf_folder(arch))
    plan = plan_memory(cfg)
    built, measured = measure_real_step(cfg)
    assert plan.n_params == built.n_params
    assert plan.saved_per_micro_batch == measured["saved_activations_per_micro_batch"]
    assert plan.memory["peak"] == pytest.approx(measured["peak"], rel=0.05)
    assert set(plan.saved_by_block) >= {"blocks.0", "blocks.1"}


@pytest.mark.slow
@pytest.mark.parametrize(
    "over",
    [
        {"memory.checkpointing": "block"},
        {"memory.checkpointing": "selective"},
        {"memory.loss_chunk": "128"},
        {"train.precision": "bf16"},
    ],
)
def test_plan_with_techniques_on_llama(over, hf_folder):
    cfg = _cfg(hf_folder("llama"), **over)
    plan = plan_memory(cfg)
    _, measured = measure_real_step(cfg)
    assert plan.saved_per_micro_batch == measured["saved_activations_per_micro_batch"]
    assert plan.memory["peak"] == pytest.approx(measured["peak"], rel=0.05)


# Every architecture the project lists as supported (README.md, docs/hf-models.md), at a real
# model's size: its published config.json's architecture numbers (no weights, nothing
# downloaded; fields that do not change the architecture are left out).
REAL_CONFIGS = {
    "llama (Llama-3-8B)": "llama-3-8b",  # packaged with onegpu
    "qwen2 (Qwen2-7B)": {
        "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_size": 3584,
        "intermediate_size": 18944, "num_hidden_layers": 28, "num_attention_heads": 28,
        "num_key_value_heads": 4, "max_position_embeddings": 131072, "max_window_layers": 28,
        "rope_theta": 1000000.0, "sliding_window": 131072, "use_sliding_window": False,
        "tie_word_embeddings": False, "vocab_size": 152064, "rms_norm_eps": 1e-06,
    },
    "mistral (Mistral-7B-v0.1)": {
        "architectures": ["MistralForCausalLM"], "model_type": "mistral", "hidden_size": 4096,
        "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
        "num_key_value_heads": 8, "max_position_embeddings": 32768, "rope_theta": 10000.0,
        "sliding_window": 4096, "vocab_size": 32000, "rms_norm_eps": 1e-05,
    },
    "phi (Phi-2)": {
        "architectures": ["PhiForCausalLM"], "model_type": "phi", "hidden_size": 2560,
        "intermediate_size": 10240, "num_hidden_layers": 32, "num_attention_heads": 32,
        "num_key_value_heads": 32, "max_position_embeddings": 2048, "vocab_size": 51200,
        "partial_rotary_factor": 0.4, "hidden_act": "gelu_new", "layer_norm_eps": 1e-05,
        "resid_pdrop": 0.1, "embd_pdrop": 0.0, "tie_word_embeddings": False,
    },
    "gpt2 (GPT-2)": {
        "architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "n_embd": 768, "n_layer": 12,
        "n_head": 12, "n_positions": 1024, "vocab_size": 50257,
    },
    "bert classifier (bert-base)": {
        "architectures": ["BertForSequenceClassification"], "model_type": "bert",
        "hidden_size": 768, "intermediate_size": 3072, "num_hidden_layers": 12,
        "num_attention_heads": 12, "max_position_embeddings": 512, "vocab_size": 30522,
        "type_vocab_size": 2, "id2label": {"0": "NEGATIVE", "1": "POSITIVE"},
        "label2id": {"NEGATIVE": 0, "POSITIVE": 1},
    },
    "gemma2 (Gemma-2-2B)": {
        "architectures": ["Gemma2ForCausalLM"], "model_type": "gemma2", "hidden_size": 2304,
        "intermediate_size": 9216, "num_hidden_layers": 26, "num_attention_heads": 8,
        "num_key_value_heads": 4, "head_dim": 256, "max_position_embeddings": 8192,
        "vocab_size": 256000, "hidden_activation": "gelu_pytorch_tanh",
        "query_pre_attn_scalar": 256, "sliding_window": 4096, "attn_logit_softcapping": 50.0,
        "final_logit_softcapping": 30.0,
    },
    "mixtral (Mixtral-8x7B)": {
        "architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "hidden_size": 4096,
        "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
        "num_key_value_heads": 8, "max_position_embeddings": 32768, "num_local_experts": 8,
        "num_experts_per_tok": 2, "rope_theta": 1000000.0, "vocab_size": 32000,
        "router_aux_loss_coef": 0.02,
    },
    "qwen2_moe (Qwen1.5-MoE-A2.7B)": {
        "architectures": ["Qwen2MoeForCausalLM"], "model_type": "qwen2_moe", "hidden_size": 2048,
        "intermediate_size": 5632, "num_hidden_layers": 24, "num_attention_heads": 16,
        "num_key_value_heads": 16, "max_position_embeddings": 8192, "max_window_layers": 21,
        "rope_theta": 1000000.0, "sliding_window": 32768, "use_sliding_window": False,
        "vocab_size": 151936, "decoder_sparse_step": 1, "moe_intermediate_size": 1408,
        "shared_expert_intermediate_size": 5632, "num_experts_per_tok": 4, "num_experts": 60,
        "norm_topk_prob": False, "tie_word_embeddings": False,
    },
    "qwen3_moe (Qwen3-30B-A3B)": {
        "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "hidden_size": 2048,
        "intermediate_size": 6144, "num_hidden_layers": 48, "num_attention_heads": 32,
        "num_key_value_heads": 4, "head_dim": 128, "max_position_embeddings": 40960,
        "max_window_layers": 48, "mlp_only_layers": [], "decoder_sparse_step": 1,
        "moe_intermediate_size": 768, "norm_topk_prob": True, "num_experts": 128,
        "num_experts_per_tok": 8, "rope_theta": 1000000.0, "vocab_size": 151936,
        "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    },
    "deepseek_v2 (DeepSeek-V2-Lite)": {
        "architectures": ["DeepseekV2ForCausalLM"], "model_type": "deepseek_v2",
        "hidden_size": 2048, "intermediate_size": 10944, "moe_intermediate_size": 1408,
        "num_hidden_layers": 27, "num_attention_heads": 16, "num_key_value_heads": 16,
        "n_routed_experts": 64, "n_shared_experts": 2, "num_experts_per_tok": 6, "n_group": 1,
        "topk_group": 1, "first_k_dense_replace": 1, "moe_layer_freq": 1, "q_lora_rank": None,
        "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
        "v_head_dim": 128, "max_position_embeddings": 163840, "vocab_size": 102400,
        "rope_theta": 10000, "rope_scaling": {"type": "yarn", "factor": 40, "beta_fast": 32,
        "beta_slow": 1, "mscale": 0.707, "mscale_all_dim": 0.707,
        "original_max_position_embeddings": 4096}, "routed_scaling_factor": 1.0,
        "topk_method": "greedy", "norm_topk_prob": False, "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
    },
    "deepseek_v3 (DeepSeek-V3)": {
        "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3",
        "hidden_size": 7168, "intermediate_size": 18432, "moe_intermediate_size": 2048,
        "num_hidden_layers": 61, "num_attention_heads": 128, "num_key_value_heads": 128,
        "n_routed_experts": 256, "n_shared_experts": 1, "num_experts_per_tok": 8,
        "n_group": 8, "topk_group": 4, "first_k_dense_replace": 3, "q_lora_rank": 1536,
        "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
        "v_head_dim": 128, "max_position_embeddings": 163840, "vocab_size": 129280,
        "rope_theta": 10000, "rope_scaling": {"type": "yarn", "factor": 40, "beta_fast": 32,
        "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0,
        "original_max_position_embeddings": 4096}, "routed_scaling_factor": 2.5,
        "norm_topk_prob": True, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    },
}  # fmt: skip
PUBLISHED_PARAMS = {  # the model cards' counts (DeepSeek-V3's without its next-token module)
    "llama (Llama-3-8B)": 8.03e9, "qwen2 (Qwen2-7B)": 7.62e9, "mistral (Mistral-7B-v0.1)": 7.24e9,
    "phi (Phi-2)": 2.78e9, "gpt2 (GPT-2)": 124.4e6, "bert classifier (bert-base)": 109.5e6,
    "gemma2 (Gemma-2-2B)": 2.61e9, "mixtral (Mixtral-8x7B)": 46.7e9,
    "qwen2_moe (Qwen1.5-MoE-A2.7B)": 14.3e9, "qwen3_moe (Qwen3-30B-A3B)": 30.5e9,
    "deepseek_v2 (DeepSeek-V2-Lite)": 15.7e9, "deepseek_v3 (DeepSeek-V3)": 671e9,
}  # fmt: skip


def _real_folder(tmp_path, name: str) -> str:
    config = REAL_CONFIGS[name]
    if isinstance(config, str):
        return config
    folder = tmp_path / name.split()[0]
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(config))
    return str(folder)


@pytest.mark.slow  # 36 cases (+ selective for the experts), each two shallow plans: ~1 minute
@pytest.mark.parametrize("precision", ["fp32", "bf16", "bf16-pure"])
@pytest.mark.parametrize("name", list(REAL_CONFIGS))
def test_every_supported_architecture_plans_at_real_size(tmp_path, name, precision):
    """The memory check's plan (two shallow copies at the real width with the per-layer lists
    cut to their depth, extrapolated to the real depth, on fake tensors) of each supported
    architecture at a real model's size comes back with a positive peak in every precision, and
    counts the model card's parameters (so the copies are the real blocks: DeepSeek-V3's past
    its three dense layers); the expert models also with selective checkpointing, whose
    recompute runs their grouped matmuls in backward. Real size throughout, but a sequence of
    128 tokens and a batch of one: the planner's time is the ops', not the tensors' sizes."""
    over = {"model.hf": _real_folder(tmp_path, name), "model.seq_len": "128",
            "train.device": "cpu", "train.precision": precision, "train.batch_size": "1",
            "train.micro_batch_size": "1", "out.progress": "false"}  # fmt: skip
    cfg = load_config(overrides=over)
    found = planned(cfg, "cpu", None, None, fast=True, speed=False)
    assert found.peak > 0
    assert found.n_params == pytest.approx(PUBLISHED_PARAMS[name], rel=0.01)
    if "moe" in name or "mixtral" in name or "deepseek" in name:
        cfg = load_config(overrides={**over, "memory.checkpointing": "selective"})
        assert planned(cfg, "cpu", None, None, fast=True, speed=False).peak > 0
