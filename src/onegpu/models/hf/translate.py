"""A folder's config.json as onegpu's [model] fields, and what the folder's architecture allows
(its attention implementations, whether its logits can be computed in chunks)."""

from __future__ import annotations

import dataclasses
from typing import Any

from onegpu.config import ConfigError, ModelConfig
from onegpu.models.hf.folder import open_hf_folder, require_transformers

# Configuration attributes by which a causal LM transforms its logits after the head: the
# chunked loss (which applies the head itself) would skip that transformation.
_LOGIT_TRANSFORMS = (
    "final_logit_softcapping",
    "logit_scale",
    "logits_scaling",
    "output_multiplier",
)


def resolve_model_config(m: ModelConfig) -> ModelConfig:
    """`m` with the fields the folder fixes filled in from its config.json (what runs, and what
    config.toml records); ConfigError if model.seq_len exceeds the model's positions."""
    folder = open_hf_folder(m.hf, m.hf_head)
    c = (
        folder.config.get_text_config()
        if hasattr(folder.config, "get_text_config")
        else folder.config
    )
    d_model, n_layer = int(c.hidden_size), int(c.num_hidden_layers)
    limit = folder.max_positions
    if limit is not None and m.seq_len > limit:
        raise ConfigError(
            "model.seq_len",
            f"{m.seq_len} exceeds the model's {limit} positions (max_position_embeddings in "
            f"{folder.path}/config.json); use --model.seq_len {limit} or less",
        )
    inner = getattr(c, "intermediate_size", None) or getattr(c, "n_inner", None) or 4 * d_model
    return dataclasses.replace(
        m,
        n_layer=n_layer,
        n_head=int(c.num_attention_heads),
        d_model=d_model,
        vocab_size=int(c.vocab_size),
        pad_vocab_to=1,  # the folder's vocabulary is the model's: nothing is padded
        mlp_ratio=max(1, round(inner / d_model)),
        tie_embeddings=bool(getattr(c, "tie_word_embeddings", False)),
        init_std=float(getattr(c, "initializer_range", m.init_std) or m.init_std),
    )


def default_attention(m: ModelConfig) -> str:
    """What `model.attention auto` means for a folder: 'sdpa' where its transformers class
    supports SDPA, else 'plain' (transformers' eager attention; e.g. Gemma-2's soft-capped
    attention scores)."""
    folder = open_hf_folder(m.hf, m.hf_head)
    transformers = require_transformers()
    auto = (
        transformers.AutoModelForSequenceClassification
        if folder.head == "sequence-classification"
        else transformers.AutoModelForCausalLM
    )
    try:
        cls = auto._model_mapping[type(folder.config)]
    except KeyError:
        return "sdpa"  # unknown here: from_config will say what is wrong
    return "sdpa" if getattr(cls, "_supports_sdpa", True) else "plain"


def attn_implementation(attention: str) -> str:
    """onegpu's model.attention -> transformers' attn_implementation. An SDPA kernel asked
    for ('flash', 'efficient', 'math') is set around each attention module's forward
    (techniques.attention.restrict_sdpa_kernel); 'plain' is transformers' 'eager' (explicit
    softmax, in fp32 for most architectures)."""
    return "eager" if attention == "plain" else "sdpa"


def chunkable_loss(m: ModelConfig) -> bool:
    """Whether a folder's model has vocabulary-sized logits that the chunked loss computes
    exactly: a causal LM that does not change its logits after the output layer."""
    folder = open_hf_folder(m.hf, m.hf_head)
    if folder.head != "causal-lm":
        return False
    configs = {id(folder.config): folder.config}
    if hasattr(folder.config, "get_text_config"):
        text = folder.config.get_text_config()
        configs[id(text)] = text
    return not any(config_logit_transform(c) for c in configs.values())


def config_logit_transform(c: Any) -> str | None:
    for name in _LOGIT_TRANSFORMS:
        value = getattr(c, name, None)
        if value not in (None, 0, 1, 1.0, 0.0, False):
            return name
    return None
