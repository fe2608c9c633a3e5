"""Where onegpu keeps what it computes once per machine: token files, trained tokenizers and
measured figures (matmul peaks, kernel choices).

Measurements are keyed by what they depend on (CPU model, threads, torch version, shapes), so a
cached figure is reused only where it still holds. This module sits at the bottom of the package
(next to config): any layer may use it, it imports none.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any


def cache_root(cache_dir: str = "") -> Path:
    """`cache_dir` if given, else $ONEGPU_CACHE, else ~/.cache/onegpu: one place for every cache."""
    root = cache_dir or os.environ.get("ONEGPU_CACHE") or Path.home() / ".cache" / "onegpu"
    return Path(root).expanduser()


def entries(name: str) -> dict[str, Any]:
    """Everything cache file `name` holds ({} where it is missing or unreadable)."""
    try:
        return json.loads((cache_root() / name).read_text())
    except (OSError, ValueError):
        return {}


def peek(name: str, key: str) -> Any | None:
    """The value stored under `key` in cache file `name`, or None: never measures."""
    return entries(name).get(key)


def cached(name: str, key: str, measure: Callable[[], Any], *, refresh: bool = False) -> Any:
    """The value stored under `key` in cache file `name`, measuring (and storing) it if absent."""
    path = cache_root() / name
    cache = entries(name)
    if refresh or key not in cache:
        cache[key] = measure()
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        tmp.write_text(json.dumps(cache, indent=1))
        os.replace(tmp, path)  # atomic: concurrent runs never read half a file
    return cache[key]
