"""Load GPT-2 weights in Hugging Face's layout (local files only: nothing is downloaded).

HF's GPT-2 stores linear layers as Conv1D with [in, out] weights; ours are nn.Linear [out, in].
"""

from __future__ import annotations

import re

import torch

from onegpu.models.gpt import GPT

_RENAMES = [
    (r"^transformer\.wte\.", "wte."),
    (r"^transformer\.wpe\.", "wpe."),
    (r"^transformer\.ln_f\.", "norm_f."),
    (r"^transformer\.h\.(\d+)\.ln_1\.", r"blocks.\1.attn.norm."),
    (r"^transformer\.h\.(\d+)\.attn\.c_attn\.", r"blocks.\1.attn.qkv."),
    (r"^transformer\.h\.(\d+)\.attn\.c_proj\.", r"blocks.\1.attn.proj."),
    (r"^transformer\.h\.(\d+)\.ln_2\.", r"blocks.\1.mlp.norm."),
    (r"^transformer\.h\.(\d+)\.mlp\.c_fc\.", r"blocks.\1.mlp.fc."),
    (r"^transformer\.h\.(\d+)\.mlp\.c_proj\.", r"blocks.\1.mlp.proj."),
    (r"^lm_head\.", "lm_head."),
]
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
