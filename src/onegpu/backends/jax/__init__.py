"""The JAX backend (`train.backend = "jax"`): onegpu's GPT in Flax, optimizers from optax,
the loop over the same data order, run folder, meter and signals as the torch backend. It
imports no torch (tests/jax/test_no_torch.py); docs/jax.md says what it supports."""

from __future__ import annotations

from onegpu.config import ConfigError


def require_jax() -> None:
    """One line, exit 2, where the extra is not installed."""
    try:
        import flax  # noqa: F401
        import jax  # noqa: F401
        import optax  # noqa: F401
    except ImportError as e:
        raise ConfigError(
            "train.backend",
            f"jax needs JAX, Flax and optax ({e.name} is not installed): "
            "pip install 'onegpu[jax]', or use --train.backend torch",
        ) from None
