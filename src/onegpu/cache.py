"""Where onegpu keeps what it computes once per machine: token files, trained tokenizers and
measured figures (matmul peaks, kernel choices).

Measurements are keyed by what they depend on (CPU model, threads, torch version, shapes), so a
cached figure is reused only where it still holds. This module sits at the bottom of the package
(next to config): any layer may use it, it imports none (but config's error, when a write fails).
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import os
import threading
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

try:
    import fcntl
except ImportError:  # not POSIX: writes are atomic, but a concurrent one may be lost
    fcntl = None  # type: ignore[assignment]


def cache_root(cache_dir: str = "") -> Path:
    """`cache_dir` if given, else $ONEGPU_CACHE, else ~/.cache/onegpu: one place for every cache."""
    root = cache_dir or os.environ.get("ONEGPU_CACHE") or Path.home() / ".cache" / "onegpu"
    return Path(root).expanduser()


@contextlib.contextmanager
def writing() -> Iterator[None]:
    """Around a write under cache_root(): a folder that cannot be made or written (ONEGPU_CACHE
    under a file, read-only, a full disk) is the user's setting to fix, one line naming it, not
    a traceback or a run's failure."""
    try:
        yield
    except OSError as e:
        from onegpu.config import ConfigError

        raise ConfigError(
            "ONEGPU_CACHE",
            f"cannot write onegpu's cache in {cache_root()} "
            f"({e.strerror or e}); set ONEGPU_CACHE to a writable folder",
        ) from None


def entries(name: str) -> dict[str, Any]:
    """Everything cache file `name` holds ({} where it is missing or unreadable)."""
    try:
        found = json.loads((cache_root() / name).read_text())
    except (OSError, ValueError):
        return {}
    return found if isinstance(found, dict) else {}  # valid JSON of another shape: ignored


def has(*numbers: str, text: tuple[str, ...] = ()) -> Callable[[Any], bool]:
    """A check of a stored value: a JSON object holding `numbers` as numbers and `text` as
    strings."""

    def valid(value: Any) -> bool:
        if not isinstance(value, dict):
            return False
        numeric = all(
            isinstance(value.get(k), (int, float)) and not isinstance(value.get(k), bool)
            for k in numbers
        )
        return numeric and all(isinstance(value.get(k), str) for k in text)

    return valid


provisional_reads: list[str] = []
"""The cache files of the timings not kept (taken on busy CPUs) that this process's choices
followed, in order: read back as provisional, or timed here on busy CPUs. A plan takes the
stretch it added and says which of its choices the next run may make otherwise."""

PROVISIONAL = "provisional.json"
"""Values `cached` measured but its `keep` rejected (a timing taken on a busy machine), by
'<file>|<key>': never read back as measured, but a plan that predicts what a run did follows
the last run's (`peek(..., provisional=True)`)."""


def peek(
    name: str,
    key: str,
    valid: Callable[[Any], bool] | None = None,
    *,
    provisional: bool = False,
) -> Any | None:
    """The value stored under `key` in cache file `name`, or None (also for a value `valid`
    rejects: a file edited by hand or by another version): never measures. `provisional`:
    else the last one measured but not kept (PROVISIONAL)."""

    def usable(found: Any) -> bool:
        return found is not None and (valid is None or valid(found))

    found = entries(name).get(key)
    if not usable(found) and provisional:  # missing, or of an older format
        found = entries(PROVISIONAL).get(f"{name}|{key}")
        if usable(found):
            provisional_reads.append(name)
    return found if usable(found) else None


def cached(
    name: str,
    key: str,
    measure: Callable[[], Any],
    *,
    refresh: bool = False,
    valid: Callable[[Any], bool] | None = None,
    keep: Callable[[Any], bool] | None = None,
) -> Any:
    """The value stored under `key` in cache file `name`, measuring (and storing) it if absent
    or if `valid` rejects what is stored; a measured value `keep` rejects is returned and
    stored apart, as provisional (PROVISIONAL)."""
    cache = entries(name)
    stale = key in cache and valid is not None and not valid(cache[key])
    if not (refresh or key not in cache or stale):
        return cache[key]
    value = measure()
    if keep is not None and not keep(value):
        _store(PROVISIONAL, f"{name}|{key}", value)
    else:
        _store(name, key, value)
        drop(PROVISIONAL, f"{name}|{key}")  # measured and kept: the guess is spent
    return value


def drop(name: str, key: str) -> None:
    """Forget what cache file `name` holds under `key` (a figure found stale)."""
    if key not in entries(name):
        return
    with _locked(name):
        _write(name, {k: v for k, v in entries(name).items() if k != key})


def _store(name: str, key: str, value: Any) -> None:
    """`value` under `key` in cache file `name`, beside what other runs stored meanwhile."""
    with _locked(name):
        _write(name, entries(name) | {key: value})


@contextlib.contextmanager
def _locked(name: str) -> Iterator[None]:
    """Cache file `name` to this writer alone, across processes and threads, from its read to
    its replacement: two runs timing at once (torchrun's ranks, a plan beside a run) otherwise
    both read the file, and the later write loses the earlier one's value. A POSIX lock on a
    file beside it (`flock`, released when the file closes, even by a killed process); none
    where the platform or the file system has none (some network and FUSE mounts refuse
    `flock`): there a concurrent write may be lost, as before locks, and nothing else."""
    path = cache_root() / f"{name}.lock"
    with writing():
        path.parent.mkdir(parents=True, exist_ok=True)
        lock = path.open("a")
    with lock:
        if fcntl is not None:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX)
            except OSError as e:  # ENOLCK, EOPNOTSUPP, ENOSYS: unlocked
                _unlocked_once(str(cache_root()), e.strerror or str(e))
        yield


@functools.cache
def _unlocked_once(root: str, why: str) -> None:
    """Said once per cache folder and process."""
    warnings.warn(
        f"{root} refuses file locks ({why}): onegpu writes its cache unlocked, and a run "
        "storing at the same moment as this one may lose its value",
        stacklevel=4,
    )


def _write(name: str, cache: dict[str, Any]) -> None:
    path = cache_root() / name
    with writing():
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".tmp{os.getpid()}-{threading.get_ident()}")
        tmp.write_text(json.dumps(cache, indent=1))
        os.replace(tmp, path)  # atomic: concurrent runs never read half a file


def digest(what: Any) -> str:
    """A short stable name for a JSON-able description (a run's shape in a cache key)."""
    return hashlib.sha256(json.dumps(what, sort_keys=True).encode()).hexdigest()[:16]
