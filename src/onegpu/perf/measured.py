"""A small on-disk cache for things measured on this machine (matmul peaks, kernel choices).

Measurements are keyed by what they depend on (CPU model, threads, torch version, shapes), so
a cached figure is reused only where it still holds.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any


def cache_path(name: str) -> Path:
    from onegpu.data.tokens import cache_root

    return cache_root() / name


def cached(name: str, key: str, measure: Callable[[], Any], *, refresh: bool = False) -> Any:
    """The value stored under `key` in cache file `name`, measuring (and storing) it if absent."""
    path = cache_path(name)
    try:
        cache = json.loads(path.read_text())
    except (OSError, ValueError):
        cache = {}
    if refresh or key not in cache:
        cache[key] = measure()
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        tmp.write_text(json.dumps(cache, indent=1))
        os.replace(tmp, path)  # atomic: concurrent runs never read half a file
    return cache[key]
