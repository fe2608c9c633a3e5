"""Flax parameters <-> the torch GPT's state dict (names, [out, in] layouts), as numpy: a
JAX run's model.safetensors is what a torch run writes, and either loads into the other.

Flax nests `blocks_3/attn/q/weight` (or, scanned, `blocks/block/attn/q/weight` with the
layers stacked on axis 0); torch names it `blocks.3.attn.q.weight`. A tied output layer is
one tensor, saved under `lm_head.weight` as safetensors.torch.save_model keeps it.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np

from onegpu.config import ConfigError, ModelConfig
from onegpu.models.qkv import split_fused_qkv
from onegpu.runs.atomic import file_mode

TOP = {"wte": "wte.weight", "wpe": "wpe.weight"}


def _flatten(tree: dict, prefix: str = "") -> dict[str, Any]:
    out = {}
    for k, v in tree.items():
        name = f"{prefix}.{k}" if prefix else k
        out.update(_flatten(v, name) if isinstance(v, dict) else {name: v})
    return out


def to_torch_names(params: dict, m: ModelConfig) -> dict[str, np.ndarray]:
    """The torch state dict (float32 numpy; a tied head under lm_head.weight only)."""
    out: dict[str, np.ndarray] = {}
    for name, value in _flatten(params).items():
        value = np.asarray(value, dtype=np.float32)
        head, _, rest = name.partition(".")
        if head in TOP:
            key = "lm_head.weight" if head == "wte" and m.tie_embeddings else TOP[head]
            out[key] = value
        elif head == "blocks":  # scanned: blocks.block.<rest>, layers on axis 0
            inner = rest.removeprefix("block.")
            for i in range(value.shape[0]):
                out[f"blocks.{i}.{inner}"] = value[i]
        elif head.startswith("blocks_"):
            out[f"blocks.{head.removeprefix('blocks_')}.{rest}"] = value
        else:  # norm_f, lm_head
            out[name] = value
    return out


def from_torch_names(
    state: dict[str, np.ndarray], template: dict, m: ModelConfig, where: str
) -> dict:
    """`template`'s tree (the model's parameters) filled from a torch state dict."""
    state = split_fused_qkv(dict(state))  # an older run's fused attention projection
    if "wte.weight" not in state and m.tie_embeddings and "lm_head.weight" in state:
        state["wte.weight"] = state["lm_head.weight"]

    def take(key: str, like) -> np.ndarray:
        if key not in state:
            raise ConfigError(
                "model.init_from",
                f"{where} has no {key}: it is not a onegpu GPT "
                "of this [model] (n_layer, d_model, bias, tie_embeddings)",
            )
        value = state[key]
        if tuple(value.shape) != tuple(like.shape):
            raise ConfigError(
                "model.init_from",
                f"{where}: {key} is {tuple(value.shape)}, this [model] wants {tuple(like.shape)}",
            )
        return value.astype(like.dtype)

    def fill(tree: dict, path: tuple[str, ...]) -> dict:
        out = {}
        for k, v in tree.items():
            here = (*path, k)
            if isinstance(v, dict):
                out[k] = fill(v, here)
                continue
            head, rest = here[0], ".".join(here[1:])
            if head in TOP:
                out[k] = take(TOP[head], v)
            elif head == "blocks":
                inner = ".".join(here[2:])
                out[k] = np.stack([take(f"blocks.{i}.{inner}", v[i]) for i in range(v.shape[0])])
            elif head.startswith("blocks_"):
                out[k] = take(f"blocks.{head.removeprefix('blocks_')}.{rest}", v)
            else:
                out[k] = take(".".join(here), v)
        return out

    return fill(template, ())


def load_safetensors(path: str | Path) -> dict[str, np.ndarray]:
    from safetensors import SafetensorError
    from safetensors.numpy import load_file

    p = Path(path).expanduser()
    if not p.is_file():
        raise ConfigError("model.init_from", f"{p} is not a file: give a model.safetensors")
    try:
        return load_file(str(p))
    except (SafetensorError, OSError, ValueError) as e:
        raise ConfigError(
            "model.init_from", f"{p} is not a readable safetensors file ({e})"
        ) from None


def write_safetensors(params: dict, m: ModelConfig, path: Path) -> None:
    """model.safetensors in the torch GPT's layout, atomically (temporary name, rename)."""
    from safetensors.numpy import save_file

    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    save_file(to_torch_names(params, m), str(tmp))
    os.chmod(tmp, file_mode())
    os.replace(tmp, path)
