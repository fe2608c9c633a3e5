"""A bench row on the JAX backend: what each torch technique becomes there (Lippe's table
compares scanned against unrolled layers where the torch rows compare regional against whole
compile), and which rows have no JAX counterpart (skipped, said in the log)."""

from __future__ import annotations

from onegpu.config import ConfigError, load_config

JAX_FOR_COMPILE = {"default": {}, "max-autotune": {}, "regional": {"model.scan_layers": "true"}}
"""train.compile on JAX: XLA compiles every step whole (unrolled layers); 'regional', one block
compiled for every layer, is what nn.scan over the layers does."""


def for_backend(overrides: dict[str, str], backend: str) -> dict[str, str]:
    """The row's overrides for `backend` (unchanged on torch)."""
    if backend != "jax" or "train.compile" not in overrides:
        return overrides
    out = {k: v for k, v in overrides.items() if k != "train.compile"}
    return {**out, **JAX_FOR_COMPILE.get(overrides["train.compile"], {})}


def refused(preset: str | None, config_file: str | None, overrides: dict[str, str]) -> str:
    """Why the row's configuration is refused ('' when it is not): a JAX row without a JAX
    counterpart is skipped rather than failing the whole bench."""
    try:
        load_config(preset, config_file, overrides)
    except ConfigError as e:
        return str(e)
    return ""
