"""Host memory allocator: tcmalloc when the system has it (docs/cpu-notes.md: +33% tokens/s on our CPUs).

glibc malloc hands large freed blocks back to the kernel, so every training step faults the
same pages in again (on this CPU ~30% of a step was kernel time). tcmalloc keeps them. An
allocator must be chosen before the process starts, so the `onegpu` command re-executes itself
once with tcmalloc in LD_PRELOAD, as `python -m torch.backends.xeon.run_cpu --enable-tcmalloc`
does. Only on machines without an NVIDIA device (the host allocator matters most when the
host computes), only if the library is installed (Debian/Ubuntu: libtcmalloc-minimal4), and
never if ONEGPU_ALLOCATOR=system. Library users calling onegpu from Python are not affected.
"""

from __future__ import annotations

import ctypes.util
import os
import sys
from pathlib import Path

ENV = "ONEGPU_ALLOCATOR"  # auto (default) | system


def find_tcmalloc() -> str | None:
    for name in ("tcmalloc_minimal", "tcmalloc"):
        lib = ctypes.util.find_library(name)
        if lib:
            return lib
    return None


def active_allocator() -> str:
    return "tcmalloc" if "tcmalloc" in os.environ.get("LD_PRELOAD", "") else "system"


def maybe_reexec_with_tcmalloc(argv: list[str]) -> None:
    """Replace this process by the same command with tcmalloc preloaded, when it applies."""
    if os.environ.get(ENV, "auto") != "auto" or active_allocator() == "tcmalloc":
        return
    if Path("/dev/nvidiactl").exists() or sys.platform != "linux":
        return
    lib = find_tcmalloc()
    if lib is None:
        return
    env = dict(os.environ)
    env["LD_PRELOAD"] = ":".join(x for x in (lib, env.get("LD_PRELOAD", "")) if x)
    env[ENV] = "tcmalloc"  # never loop, even if the preload silently fails
    os.execve(sys.executable, [sys.executable, "-m", "onegpu", *argv], env)
