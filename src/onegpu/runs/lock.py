"""One writer per run folder: an advisory lock held for the run's life.

`fcntl.flock` on `<run>/.onegpu.lock`, which holds the holder's PID. The kernel releases the
lock when the holder dies (kill -9 included), so a lock file left by a dead run is stale by
construction: the next run takes it. A second run into the same folder while the first is
alive is refused with exit 2, naming the holder's PID, before it writes anything.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
from pathlib import Path

from onegpu.config import ConfigError

LOCK_NAME = ".onegpu.lock"
_held: dict[Path, tuple[int, bool]] = {}  # folder -> (open descriptor, whether we made it)


def hold_run_folder(path: Path, field: str = "out.dir") -> None:
    """Lock `path` (made if missing) for this process's life, or ConfigError naming the PID
    that holds it."""
    path = path.absolute()
    if path in _held:
        return
    made = not path.exists()
    path.mkdir(parents=True, exist_ok=True)
    fd = os.open(path / LOCK_NAME, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
        os.close(fd)
        raise ConfigError(
            field,
            f"{path} is in use by another onegpu run (PID {holder}); wait for it to finish, "
            "or pick another folder",
        ) from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    _held[path] = (fd, made)


def release_run_folder(path: Path, *, unused: bool = False) -> None:
    """Let go of `path`'s lock; `unused`: the run never started, so a folder this process made
    goes again (a refused run leaves nothing behind)."""
    path = path.absolute()
    fd, made = _held.pop(path, (None, False))
    if fd is None:
        return
    with contextlib.suppress(OSError):
        os.close(fd)
    if unused:
        with contextlib.suppress(OSError):
            (path / LOCK_NAME).unlink()
            if made and not any(path.iterdir()):
                path.rmdir()
