"""GPT-2 weights between Hugging Face's layout and our GPT, both ways (local files only).

Our GPT is GPT-2's architecture: HF's GPT2LMHeadModel with the same weights computes the same
function (tested to 1e-5 in fp32). HF's GPT-2 stores linear layers as Conv1D with [in, out]
weights; ours are nn.Linear [out, in].
"""

from __future__ import annotations

import re

import torch

from onegpu.config import ConfigError
from onegpu.models.gpt import GPT
from onegpu.models.qkv import split_fused_qkv

# (HF GPT2LMHeadModel prefix, our prefix); {i} is a block index. Read both ways.
_NAMES = [
    ("transformer.wte.", "wte."),
    ("transformer.wpe.", "wpe."),
    ("transformer.ln_f.", "norm_f."),
    ("transformer.h.{i}.ln_1.", "blocks.{i}.attn.norm."),
    ("transformer.h.{i}.attn.c_attn.", "blocks.{i}.attn.qkv."),
    ("transformer.h.{i}.attn.c_proj.", "blocks.{i}.attn.proj."),
    ("transformer.h.{i}.ln_2.", "blocks.{i}.mlp.norm."),
    ("transformer.h.{i}.mlp.c_fc.", "blocks.{i}.mlp.fc."),
    ("transformer.h.{i}.mlp.c_proj.", "blocks.{i}.mlp.proj."),
    ("lm_head.", "lm_head."),
]


def _rules(to_ours: bool) -> list[tuple[str, str]]:
    """(regex, replacement) pairs renaming HF keys to ours, or ours to HF's."""
    rules = []
    for hf, ours in _NAMES:
        src, dst = (hf, ours) if to_ours else (ours, hf)
        pattern = "^" + re.escape(src).replace(r"\{i\}", r"(\d+)")
        rules.append((pattern, dst.replace("{i}", r"\1")))
    return rules


_RENAMES = _rules(to_ours=True)
_INVERSE = _rules(to_ours=False)
_CONV1D = re.compile(r"(c_attn|c_proj|c_fc)\.weight$")


def state_dict_from_hf_gpt2(hf_state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Rename and transpose an HF GPT2LMHeadModel state dict into onegpu's GPT layout."""
    out: dict[str, torch.Tensor] = {}
    for key, value in hf_state.items():
        if key.endswith((".attn.bias", ".attn.masked_bias")):  # causal-mask buffers of old HF
            continue
        new = key
        for pattern, repl in _RENAMES:
            new, n = re.subn(pattern, repl, new)
            if n:
                break
        else:
            raise KeyError(f"unexpected GPT-2 weight {key!r}")
        out[new] = value.t().contiguous() if _CONV1D.search(key) else value
    return split_fused_qkv(out)


def fuse_qkv(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The inverse of `split_fused_qkv`: GPT-2's layout has one fused attention projection."""
    out = {}
    for key, value in state.items():
        stem, q, leaf = key.rpartition("attn.q.")
        if q:
            parts = [state[f"{stem}attn.{name}.{leaf}"] for name in "qkv"]
            out[f"{stem}attn.qkv.{leaf}"] = torch.cat(parts, dim=0)
        elif not (".attn.k." in key or ".attn.v." in key):
            out[key] = value
    return out


def load_hf_gpt2(model: GPT, hf_state: dict[str, torch.Tensor]) -> GPT:
    state = state_dict_from_hf_gpt2(hf_state)
    for key in ("wte.weight", "lm_head.weight", "lm_head.bias"):  # zero rows pad the vocabulary
        if key in state and state[key].shape[0] < model.padded_vocab:
            extra = model.padded_vocab - state[key].shape[0]
            state[key] = torch.cat([state[key], state[key].new_zeros(extra, *state[key].shape[1:])])
    if model.cfg.tie_embeddings:
        state.pop("lm_head.weight", None)
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [k for k in missing if not (k == "lm_head.weight" and model.cfg.tie_embeddings)]
    if missing or unexpected:
        raise KeyError(f"GPT-2 weights do not fit: missing {missing}, unexpected {unexpected}")
    model.tie_weights()
    return model


def gpt2_config_kwargs(model: GPT, *, eos_token_id: int | None = None) -> dict:
    """transformers.GPT2Config arguments for our GPT (ConfigError, naming the option, for what
    GPT-2's architecture cannot express)."""
    cfg = model.cfg
    if model.lm_head.bias is not None:
        raise ConfigError(
            "model.bias",
            "this model's untied output layer has a bias, which GPT-2's lm_head lacks; it "
            "cannot be exported as GPT2LMHeadModel",
        )
    kwargs = dict(
        vocab_size=cfg.vocab_size,
        n_positions=cfg.seq_len,
        n_embd=cfg.d_model,
        n_layer=cfg.n_layer,
        n_head=cfg.n_head,
        n_inner=cfg.mlp_ratio * cfg.d_model,
        activation_function="gelu_new",  # GELU, tanh form: ours
        resid_pdrop=cfg.dropout,
        embd_pdrop=cfg.dropout,
        attn_pdrop=cfg.dropout,
        layer_norm_epsilon=1e-5,  # nn.LayerNorm's default, which our blocks use
        initializer_range=cfg.init_std,
        tie_word_embeddings=cfg.tie_embeddings,
        architectures=["GPT2LMHeadModel"],
    )
    if eos_token_id is not None:
        kwargs.update(bos_token_id=eos_token_id, eos_token_id=eos_token_id)
    return kwargs


def hf_gpt2_state_dict(model: GPT) -> dict[str, torch.Tensor]:
    """Our GPT's weights in GPT2LMHeadModel's layout: vocabulary padding dropped, Linear
    weights transposed into Conv1D's [in, out], and zeros for the biases of a bias-free model
    (GPT-2 always has them; zero biases compute the same function)."""
    ours = fuse_qkv({k: v.detach().float() for k, v in model.state_dict().items()})
    back = {new: old for old, new in _inverse_names(ours)}
    out: dict[str, torch.Tensor] = {}
    V, D = model.cfg.vocab_size, model.cfg.d_model
    for hf_key, our_key in back.items():
        value = ours[our_key]
        if our_key in ("wte.weight", "lm_head.weight"):
            value = value[:V]
        out[hf_key] = value.t().contiguous() if _CONV1D.search(hf_key) else value.contiguous()
    for i in range(model.cfg.n_layer):  # GPT-2 has every bias: zeros where ours has none
        h = f"transformer.h.{i}"
        F_ = model.cfg.mlp_ratio * D
        for key, size in (
            (f"{h}.ln_1.bias", D),
            (f"{h}.ln_2.bias", D),
            (f"{h}.attn.c_attn.bias", 3 * D),
            (f"{h}.attn.c_proj.bias", D),
            (f"{h}.mlp.c_fc.bias", F_),
            (f"{h}.mlp.c_proj.bias", D),
        ):
            out.setdefault(key, torch.zeros(size))
    out.setdefault("transformer.ln_f.bias", torch.zeros(D))
    if model.cfg.tie_embeddings:
        out.pop("lm_head.weight", None)
    return out


def _inverse_names(ours: dict[str, torch.Tensor]):
    """(our key, HF key) for every weight of our GPT."""
    for key in ours:
        for pattern, repl in _INVERSE:
            new, n = re.subn(pattern, repl, key)
            if n:
                yield key, new
                break
        else:
            raise KeyError(f"unexpected weight {key!r} in onegpu's GPT")
