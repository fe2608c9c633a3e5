"""The optional optimizer packages, imported where an optimizer needs one: a missing package is
one line naming the extra that installs it."""

from __future__ import annotations

from types import ModuleType

from onegpu.config import ConfigError


def pytorch_optimizer(name: str) -> ModuleType:
    """pytorch-optimizer, for optimizer `name` (LAMB, LARS, GaLore, APOLLO, Adam-mini)."""
    try:
        import pytorch_optimizer as package
    except ImportError as e:
        raise ConfigError(
            "optim.name", f"{name} needs pytorch-optimizer ({e}); pip install 'onegpu[optimizers]'"
        ) from None
    return package
