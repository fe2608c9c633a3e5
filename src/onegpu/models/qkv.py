"""The attention's projections under their names: one each for queries, keys and values.

GPT-2's checkpoints (`c_attn`) and this project's runs before the projections were split hold
one fused `attn.qkv` of [3 x d_model, d_model]: its thirds are the three projections. Works on
torch tensors and numpy arrays alike (the JAX backend reads the same files, without torch).
"""

from __future__ import annotations

from typing import Any, TypeVar

Array = TypeVar("Array", bound=Any)


def split_fused_qkv(state: dict[str, Array]) -> dict[str, Array]:
    """`state` with every fused `attn.qkv.<leaf>` replaced by `attn.q`, `attn.k`, `attn.v`."""
    out = {}
    for key, value in state.items():
        stem, fused, leaf = key.rpartition("attn.qkv.")
        if not fused:
            out[key] = value
            continue
        n = value.shape[0] // 3
        for i, name in enumerate("qkv"):
            out[f"{stem}attn.{name}.{leaf}"] = value[i * n : (i + 1) * n]
    return out
