"""A bench row on the JAX backend: what each torch technique becomes there (Lippe's table
compares scanned against unrolled layers where the torch rows compare regional against whole
compile), and which rows have no JAX counterpart (skipped, said in the log)."""

from __future__ import annotations

from onegpu.config import ConfigError, load_config

JAX_FOR_COMPILE = {"default": {}, "max-autotune": {}, "regional": {"model.scan_layers": "true"}}
"""train.compile on JAX: XLA compiles every step whole (unrolled layers); 'regional', one block
compiled for every layer, is what nn.scan over the layers does."""


def for_backend(overrides: dict[str, str], backend: str) -> dict[str, str]:
    """The row's overrides for `backend` (unchanged on torch). Remat rows scan the layers on
    JAX, as Lippe's remat rows do: XLA (on this CPU) plans the same temporaries for unrolled
    layers with or without remat (small preset, fp32: 940 MiB none, 952 block), scanned with
    block remat 218 MiB (docs/jax.md)."""
    if backend != "jax":
        return overrides
    out = {k: v for k, v in overrides.items() if k != "train.compile"}
    if "train.compile" in overrides:
        out |= JAX_FOR_COMPILE.get(overrides["train.compile"], {})
    remat = overrides.get("memory.checkpointing", "none")
    if remat != "none" and not remat.startswith("every:"):
        out["model.scan_layers"] = "true"
    return out


def refused(preset: str | None, config_file: str | None, overrides: dict[str, str]) -> str:
    """Why the row's configuration is refused ('' when it is not): a JAX row without a JAX
    counterpart is skipped rather than failing the whole bench."""
    try:
        load_config(preset, config_file, overrides)
    except ConfigError as e:
        return str(e)
    return ""
