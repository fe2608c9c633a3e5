"""JAX checkpoints are pruned as the torch ones are, and a missing extra is one line."""

from __future__ import annotations

import sys

import numpy as np
import pytest

pytest.importorskip("flax")

from onegpu.backends.jax import checkpoint as state  # noqa: E402
from onegpu.backends.jax import require_jax  # noqa: E402
from onegpu.config import ConfigError  # noqa: E402


def test_keep_last_and_keep_every_prune_jax_checkpoints(tmp_path):
    for step in range(1, 7):
        state.save(tmp_path, step, {"step": step, "w": np.full(2, step)}, keep_last=2, keep_every=3)
    assert [s for s, _ in state.found(tmp_path)] == [6, 5, 3]
    assert state.read(tmp_path / state.checkpoint_name(5))["step"] == 5


def test_without_the_extra_the_backend_is_refused_in_one_line(monkeypatch):
    monkeypatch.setitem(sys.modules, "optax", None)
    with pytest.raises(ConfigError, match=r"train\.backend.*onegpu\[jax\]"):
        require_jax()
