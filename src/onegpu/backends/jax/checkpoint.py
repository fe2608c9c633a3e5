"""A JAX run's state as checkpoint bytes, and back: the shared part (runs/checkpoints.py, whose
rules every backend's checkpoints follow), the parameters and the optimizer state in one
msgpack file per step (`checkpoints/step-00000040.jax`). The position in the data is the step
(the order is a function of seed and sample index, data/windows.py) and dropout's key is
folded from the step, so a resumed run continues bit for bit."""

from __future__ import annotations

import json
from pathlib import Path
from typing import IO, Any

from flax import serialization

from onegpu.config import ConfigError

SUFFIX = ".jax"


def write(f: IO[bytes], state: dict[str, Any]) -> None:
    """`state` as msgpack; its config (plain containers) as JSON, which msgpack's flax tree
    conversion would turn lists of into dicts."""
    tree = {**state, "config": json.dumps(state["config"])}
    f.write(serialization.msgpack_serialize(serialization.to_state_dict(tree)))


def read(path: Path) -> dict[str, Any]:
    """A checkpoint's state, or ConfigError naming train.resume when it does not load."""
    try:
        state = serialization.msgpack_restore(path.read_bytes())
    except (OSError, ValueError, TypeError) as e:  # msgpack errors are ValueErrors
        raise ConfigError(
            "train.resume",
            f"{path} does not load ({e}); give another "
            "checkpoint or start afresh with --train.resume ''",
        ) from None
    if isinstance(state, dict) and isinstance(state.get("config"), str):
        state["config"] = json.loads(state["config"])
    return state


def restore(template: Any, saved: Any) -> Any:
    """A saved tree into the structure of `template` (parameters, optimizer state)."""
    return serialization.from_state_dict(template, saved)
