"""onegpu's C++ CPU kernels (`csrc/`), each built on first use by torch's `cpp_extension` with the
compiler inductor uses, for torch's own CPU dispatch level (AVX512, AVX2 or none), and cached by
torch under ~/.cache/torch_extensions (rebuilt where the source changed)."""

from __future__ import annotations

import functools
import os
import warnings
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import torch

CSRC = Path(__file__).parent / "csrc"
ISA_FLAGS = {
    "AVX512": [
        "-DCPU_CAPABILITY=AVX512",
        "-DCPU_CAPABILITY_AVX512",
        "-mavx512f",
        "-mavx512bw",
        "-mavx512vl",
        "-mavx512dq",
        "-mfma",
    ],
    "AVX2": ["-DCPU_CAPABILITY=AVX2", "-DCPU_CAPABILITY_AVX2", "-mavx2", "-mfma", "-mf16c"],
}
"""Compiler flags per torch's CPU dispatch level (`torch.backends.cpu.get_cpu_capability()`):
those ATen's own vectorised kernels are built with, so `at::vec` takes the same code paths."""


@functools.cache
def load(stem: str) -> ModuleType:
    """The kernel `csrc/<stem>.cpp`, built once per torch version and CPU dispatch level."""
    from torch.utils.cpp_extension import load as build

    _ninja_on_path()
    level = torch.backends.cpu.get_cpu_capability()
    flags = ["-O3", "-fopenmp", *ISA_FLAGS.get(level, [])]  # OpenMP: at::parallel_for's threads
    version = torch.__version__.split("+")[0].replace(".", "_")
    return build(
        name=f"onegpu_{stem}_{level.lower()}_torch{version}",
        sources=[str(CSRC / f"{stem}.cpp")],
        extra_cflags=flags,
        extra_ldflags=["-fopenmp"],
        verbose=False,
    )


def builds(make: Callable[[], object], what: str, instead: str) -> bool:
    """Whether `make()` (a kernel's build) succeeds here. Where it does not (a compiler that
    inductor finds but that lacks Python's headers, say), a warning says why and what runs
    `instead`; the caller caches the answer, so it is said once."""
    try:
        make()
    except Exception as e:  # noqa: BLE001 - any failure to build means the same fallback
        first = (str(e).splitlines() or [""])[0][:200]
        warnings.warn(
            f"onegpu's C++ {what} did not build ({type(e).__name__}: {first}); {instead}",
            stacklevel=3,
        )
        return False
    return True


def _ninja_on_path() -> None:
    """torch builds with the `ninja` it finds on PATH: the PyPI package's (a dependency) where the
    system has none, found even where its bin folder is not on PATH (a venv not activated)."""
    try:
        import ninja
    except ImportError:  # torch's own error names it
        return
    path = os.environ.get("PATH", "")
    if ninja.BIN_DIR not in path.split(os.pathsep):
        os.environ["PATH"] = os.pathsep.join([ninja.BIN_DIR, path]) if path else ninja.BIN_DIR
