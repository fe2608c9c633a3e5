"""A folder's safetensors weights copied into a model built from its config.

Most folders hold the model's own parameter names. A folder in an architecture's original
layout that transformers converts while loading (transformers 5: a mixture of experts saved
with one tensor per expert, `experts.0.w1.weight`, for a model holding them fused,
`experts.gate_up_proj`) is read through transformers' own `from_pretrained` on the CPU, which
applies its conversion, and the converted tensors are copied in: one more host copy of the
weights, for those folders only."""

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
    folder = files[0].parent
    if _needs_conversion(files, own):
        _copy_converted(model, folder, own, seen)
        files = ()
    for file in files:
        try:
            _copy_file(file, own, seen)
        except (OSError, SafetensorError) as e:
            reason = str(e).splitlines()[0] if str(e) else type(e).__name__
            raise ConfigError(
                "model.hf",
                f"{file} is not a readable safetensors file "
                f"({reason}): truncated or damaged; copy it again",
            ) from None
    params = {n for n, _ in model.named_parameters(remove_duplicate=False)}
    missing = sorted(k for k in params - seen if tied.get(k) not in seen)
    if missing:
        raise ConfigError(
            "model.hf",
            f"the weights in {folder} lack {missing[0]} ({len(missing)} missing)",
        )


def _needs_conversion(files: tuple[Path, ...], own: dict) -> bool:
    """Some file names a key the model lacks, and this transformers converts layouts."""
    from safetensors import SafetensorError, safe_open

    try:
        foreign = False
        for file in files:  # headers only: no tensor is read
            with safe_open(str(file), framework="pt", device="cpu") as f:
                keys = f.keys()
            foreign = foreign or any(k not in own and not k.endswith(_OLD_BUFFERS) for k in keys)
    except (OSError, SafetensorError):
        return False  # the copy below says which file is damaged
    if not foreign:
        return False
    try:
        from transformers import conversion_mapping  # noqa: F401 - transformers 5's converter
    except ImportError:
        return False
    return True


def _copy_converted(model: nn.Module, folder: Path, own: dict, seen: set[str]) -> None:
    """transformers' from_pretrained (with its conversion) on the CPU, then a copy into `model`."""
    dtype = next(iter(own.values())).dtype
    try:
        loaded = type(model).from_pretrained(
            folder, config=model.config, dtype=dtype, local_files_only=True
        )
    except (OSError, ValueError, RuntimeError) as e:
        reason = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise ConfigError(
            "model.hf",
            f"transformers could not read the weights in {folder} "
            f"({reason}); check the folder against its config.json",
        ) from None
    for key, value in loaded.state_dict().items():
        if key in own:
            target = own[key]
            if target.shape != value.shape:
                raise ConfigError(
                    "model.hf",
                    f"{folder}: {key} has shape {tuple(value.shape)}, "
                    f"the config says {tuple(target.shape)}",
                )
            target.data.copy_(value)
            seen.add(key)
    del loaded


_OLD_BUFFERS = ("attn.bias", "attn.masked_bias")  # GPT-2's old causal-mask buffers


def _copy_file(file: Path, own: dict, seen: set[str]) -> None:
    """One safetensors file's tensors into the model's (ConfigError for a foreign key or a
    shape the config does not have)."""
    from safetensors import safe_open

    with safe_open(str(file), framework="pt", device="cpu") as f:
        for key in f.keys():  # noqa: SIM118 - safe_open is not a mapping
            if key not in own:
                if key.endswith(_OLD_BUFFERS):
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
