"""A folder's safetensors weights copied into a model built from its config."""

from __future__ import annotations

from pathlib import Path

from torch import nn

from onegpu.config import ConfigError


def load_safetensors_into(model: nn.Module, files: tuple[Path, ...]) -> None:
    """Copy a folder's weights into `model` (same keys as `model.state_dict()`). Every parameter
    must be found, except those tied to one that is; anything unknown in the files is an error."""
    from safetensors import SafetensorError

    own = model.state_dict(keep_vars=True)
    tied = _tied_aliases(model)
    seen: set[str] = set()
    for file in files:
        try:
            _copy_file(file, own, seen)
        except (OSError, SafetensorError) as e:
            reason = str(e).splitlines()[0] if str(e) else type(e).__name__
            raise ConfigError("model.hf", f"{file} is not a readable safetensors file "
                              f"({reason}): truncated or damaged; copy it again") from None  # fmt: skip
    params = {n for n, _ in model.named_parameters(remove_duplicate=False)}
    missing = sorted(k for k in params - seen if tied.get(k) not in seen)
    if missing:
        raise ConfigError(
            "model.hf",
            f"the weights in {files[0].parent} lack {missing[0]} ({len(missing)} missing)",
        )


def _copy_file(file: Path, own: dict, seen: set[str]) -> None:
    """One safetensors file's tensors into the model's (ConfigError for a foreign key or a
    shape the config does not have)."""
    from safetensors import safe_open

    with safe_open(str(file), framework="pt", device="cpu") as f:
        for key in f.keys():  # noqa: SIM118 - safe_open is not a mapping
            if key not in own:
                if key.endswith(("attn.bias", "attn.masked_bias")):  # old causal-mask buffers
                    continue
                raise ConfigError("model.hf", f"{file} holds {key!r}, which the model lacks")
            target, value = own[key], f.get_tensor(key)
            if target.shape != value.shape:
                raise ConfigError(
                    "model.hf",
                    f"{file}: {key} has shape {tuple(value.shape)}, the config says "
                    f"{tuple(target.shape)}",
                )
            target.data.copy_(value)
            seen.add(key)


def _tied_aliases(model: nn.Module) -> dict[str, str]:
    """name -> another name of the same parameter object (tied weights)."""
    first: dict[int, str] = {}
    alias: dict[str, str] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) in first:
            alias[name], alias[first[id(p)]] = first[id(p)], name
        else:
            first[id(p)] = name
    return alias
