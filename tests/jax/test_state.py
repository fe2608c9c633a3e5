"""Without the extra, the JAX backend is one line (its checkpoints follow the shared rules:
tests/runs/test_lifecycle.py)."""

from __future__ import annotations

import sys

import pytest

pytest.importorskip("flax")

from onegpu.backends.jax import require_jax  # noqa: E402
from onegpu.config import ConfigError  # noqa: E402


def test_without_the_extra_the_backend_is_refused_in_one_line(monkeypatch):
    monkeypatch.setitem(sys.modules, "optax", None)
    with pytest.raises(ConfigError, match=r"train\.backend.*onegpu\[jax\]"):
        require_jax()
