"""Library notes that are not our user's concern, kept off their terminal.

- torchao logs "Failed to load ... .so" for each CUDA-only kernel library on a machine without
  one, and torch notes its own enum registrations (`torch.utils._pytree`): logging raised to
  ERROR for those two loggers, once, before torchao or transformers is imported.
- torchao's 8-bit optimizer state warns that it lacks a hash for AOT autograd's cache.
- This torch build's profiler (kineto) prints `USDT: ... profiler_start` / `profiler_stop` from
  C++ on every start and stop, straight to file descriptor 2: `native_notes_dropped` runs a
  block with that descriptor captured and writes back every line but those.

Errors pass through all three.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import sys
import tempfile
import warnings
from collections.abc import Iterator

NOISY_LOGGERS = ("torchao", "torch.utils._pytree")
NATIVE_NOTES = re.compile(r"^USDT:.*(profiler_start|profiler_stop)")


def library_notes_off() -> None:
    """Before importing torchao or transformers."""
    for name in NOISY_LOGGERS:
        logging.getLogger(name).setLevel(logging.ERROR)
    warnings.filterwarnings("ignore", message=r".*does not implement _stable_hash_for_caching")


@contextlib.contextmanager
def native_notes_dropped() -> Iterator[None]:
    """Run the block with fd 2 captured; write back every line but the profiler's notes."""
    try:
        fd = sys.stderr.fileno()
    except (AttributeError, ValueError, OSError):  # no real stderr (pytest capture, a notebook)
        yield
        return
    sys.stderr.flush()
    saved = os.dup(fd)
    with tempfile.TemporaryFile() as captured:
        os.dup2(captured.fileno(), fd)
        try:
            yield
        finally:
            sys.stderr.flush()
            os.dup2(saved, fd)
            os.close(saved)
            captured.seek(0)
            kept = [
                ln
                for ln in captured.read().decode(errors="replace").splitlines(True)
                if not NATIVE_NOTES.match(ln)
            ]
            if kept:
                sys.stderr.write("".join(kept))
                sys.stderr.flush()
