"""Host memory allocator: fast on a fresh machine, with no system package.

A CPU training step frees and re-allocates the same large buffers every step. glibc malloc
serves large blocks with fresh `mmap`s and returns freed memory at the top of its heap to the
kernel (`trim`), so each step faults the same pages in again, zero-filled by the kernel: on our
2-core EPYC ~2 million minor faults in 11 steps of a 6-layer model (benchmarks/results/
allocators-B.md). A caching allocator keeps them. The `onegpu` command picks, before it starts
working, the first of:

1. `tcmalloc`, when the system has it (Debian/Ubuntu: libtcmalloc-minimal4);
2. `mimalloc` from the `cmeel-mimalloc` wheel, a dependency of onegpu on Linux (x86_64 and
   aarch64), so a plain `pip install` has it. Preloaded with `MIMALLOC_PURGE_DELAY=-1` (unless
   the environment sets it): freed pages stay with the process, as tcmalloc keeps them, since
   the next step asks for the same sizes again. Measured on model B (fp32, 3 rounds): mimalloc
   as shipped 0.96x of tcmalloc's tokens/s with 188 K minor faults; never purging 1.01x with
   48 K, at +5% peak RSS (+2% over tcmalloc's). On a bf16 CPU (benchmarks/results/
   allocator-settings-bf16.md) purging after 10 ms / 1 s costs 22% / 4% of B's speed and 22% of
   A's for 2-6% of RSS; glibc tuned is as fast but 42% heavier on A: never purging stays.
   An allocator must be chosen before the process starts, so for 1 and 2 the command
   re-executes itself once with the library in LD_PRELOAD, as `python -m
   torch.backends.xeon.run_cpu --enable-tcmalloc` does;
3. `glibc-tuned`, in-process, where no preload happened (library users calling `onegpu.train`
   from Python get this one; `apply()` gives it to any process): `mallopt` so that large blocks
   come from the heap (`M_MMAP_MAX` 0) and freed memory stays there (`M_TRIM_THRESHOLD`,
   `M_TOP_PAD`). It cuts the faults ~4x, at ~10% more peak RSS.

Only on Linux machines without an NVIDIA device (the host allocator matters most when the host
computes). `ONEGPU_ALLOCATOR` = auto (default) | tcmalloc | mimalloc | glibc-tuned | system
forces one (any other value is refused in one line, exit 2); `summary.json["allocator"]`
records what ran.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import sys
from pathlib import Path

ENV = "ONEGPU_ALLOCATOR"
CHOICES = ("auto", "tcmalloc", "mimalloc", "glibc-tuned", "system")
_REEXECED = "ONEGPU_ALLOCATOR_PRELOADED"  # set by the re-exec: never loop
MIMALLOC_PURGE = "MIMALLOC_PURGE_DELAY"  # ms before mimalloc returns freed pages; -1: never

# glibc's mallopt parameters (malloc.h)
M_TRIM_THRESHOLD, M_TOP_PAD, M_MMAP_MAX = -1, -2, -4
KEEP_BYTES = 2**31 - 1  # the largest threshold mallopt takes (an int): freed memory is kept
TOP_PAD = 64 * 2**20  # grow the heap 64 MiB at a time: fewer brk calls

_tuned = False


def find_tcmalloc() -> str | None:
    for name in ("tcmalloc_minimal", "tcmalloc"):
        lib = ctypes.util.find_library(name)
        if lib:
            return lib
    return None


def find_mimalloc() -> str | None:
    """libmimalloc.so of the cmeel-mimalloc wheel, if installed."""
    from importlib import metadata

    try:
        files = metadata.files("cmeel-mimalloc") or []
    except metadata.PackageNotFoundError:
        return None
    for f in files:
        if f.name == "libmimalloc.so":
            path = Path(str(f.locate()))
            if path.is_file():
                return str(path.resolve())
    return None


def active_allocator() -> str:
    """What serves this process's host memory: tcmalloc, mimalloc, glibc-tuned or system."""
    preload = os.environ.get("LD_PRELOAD", "")
    for name in ("tcmalloc", "mimalloc"):
        if name in preload:
            return name
    return "glibc-tuned" if _tuned else "system"


def _choice() -> str:
    """ONEGPU_ALLOCATOR, checked: a misspelt name refused rather than silently run as auto."""
    choice = os.environ.get(ENV, "") or "auto"
    if choice not in CHOICES:
        from onegpu.config import ConfigError

        raise ConfigError(ENV, f"unknown allocator {choice!r}; use one of {', '.join(CHOICES)}")
    return choice


def _applies() -> bool:
    if _choice() == "system" or sys.platform != "linux":
        return False
    return not Path("/dev/nvidiactl").exists()


def apply() -> str:
    """Tune glibc malloc for training in this process, where it applies; returns
    `active_allocator()`. Safe to call more than once, and a no-op under tcmalloc or musl."""
    global _tuned
    if not _applies() or _tuned or active_allocator() in ("tcmalloc", "mimalloc"):
        return active_allocator()
    try:
        libc = ctypes.CDLL(None)
    except OSError:
        return active_allocator()
    if not hasattr(libc, "gnu_get_libc_version"):  # not glibc: other mallopt semantics
        return active_allocator()
    mallopt = libc.mallopt
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    _tuned = all(
        mallopt(param, value) == 1
        for param, value in ((M_MMAP_MAX, 0), (M_TRIM_THRESHOLD, KEEP_BYTES), (M_TOP_PAD, TOP_PAD))
    )
    return active_allocator()


def _preload() -> tuple[str, str] | None:
    """(name, library) of the allocator `onegpu train` would preload into this process, or
    None where it would not (one is preloaded already, it does not apply, none is found)."""
    choice = _choice()
    if not _applies() or choice == "glibc-tuned" or os.environ.get(_REEXECED):
        return None
    if active_allocator() in ("tcmalloc", "mimalloc"):  # the user preloaded one already
        return None
    found = {"tcmalloc": find_tcmalloc, "mimalloc": find_mimalloc}
    order = [choice] if choice in found else list(found)
    return next(((name, path) for name in order if (path := found[name]())), None)


def run_allocator() -> str:
    """The allocator `onegpu train` runs under on this machine: the one it would preload, else
    this process's (a plan, run under glibc, reads the timings a run made under its own)."""
    preload = _preload()
    if preload is not None:
        return preload[0]
    active = active_allocator()
    return "glibc-tuned" if active == "system" and _applies() else active


def maybe_reexec_with_fast_allocator(argv: list[str]) -> None:
    """Replace this process by the same command with tcmalloc (else the wheel's mimalloc)
    preloaded, when it applies."""
    preload = _preload()
    if preload is None:
        return
    lib = preload[1]
    env = dict(os.environ)
    env["LD_PRELOAD"] = ":".join(x for x in (lib, env.get("LD_PRELOAD", "")) if x)
    if lib == find_mimalloc():
        env.setdefault(MIMALLOC_PURGE, "-1")  # keep freed pages: the next step reuses them
    env[_REEXECED] = "1"  # never loop, even if the preload silently fails
    os.execve(sys.executable, [sys.executable, "-m", "onegpu", *argv], env)


def release_free_memory() -> str:
    """Hand the pages this process's allocator holds free back to the kernel, once (after a
    one-off peak such as the profiled step: otherwise mimalloc with purging off, tcmalloc and
    tuned glibc keep them for the rest of the run). Returns which call it made ('' for none)."""
    try:
        libc = ctypes.CDLL(None)
    except OSError:
        return ""
    for name, args in (
        ("mi_collect", (True,)),
        ("MallocExtension_ReleaseFreeMemory", ()),
        ("malloc_trim", (0,)),
    ):
        fn = getattr(libc, name, None)
        if fn is not None:
            fn(*args)
            return name
    return ""
