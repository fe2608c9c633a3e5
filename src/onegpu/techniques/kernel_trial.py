"""The rule every kernel `auto` may compile follows (`train.loss_kernel`, `train.gelu_kernel`):
ATen's kernel and the compiled one timed interleaved at the run's shape, once per device and
allocator (cached by the caller); compiled where it is MIN_GAIN faster and saves more over the
run's calls than its compile costs."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch._dynamo.exc import BackendCompilerFailed

from onegpu.cache import peek
from onegpu.config import ConfigError
from onegpu.perf.contention import follows_last_run, measured_here, timed_cached

MIN_MICRO_BATCHES = 100
"""Runs of fewer micro-batches keep ATen's kernels without timing: a first compile costs
seconds that a short run does not win back."""
MIN_GAIN = 1.02
"""The compiled kernel is kept only where it runs at least this much faster (two timings of
one kernel differ by about 1%)."""
ROUNDS = 4
"""Timed rounds, ATen's and compiled interleaved; the first warms up (the compiled one compiles)."""


def time_both(run: Callable[[bool], float]) -> dict[str, Any]:
    """`run(compiled)` -> seconds, ROUNDS times each, interleaved: each one's minimum after the
    first round; the compiled first round's excess is the compile time. A compile that fails
    (no C++ compiler, say) is recorded as such."""
    times: dict[str, list[float]] = {"eager": [], "compiled": []}
    for _ in range(ROUNDS):
        times["eager"].append(run(False))
        try:
            times["compiled"].append(run(True))
        except BackendCompilerFailed as e:  # inductor could not build it: stay eager
            first = (str(e).splitlines() or [""])[0]
            return {"failed": f"{type(e).__name__}: {first[:200]}"}
    eager_s, compiled_s = min(times["eager"][1:]), min(times["compiled"][1:])
    return {
        "eager_s": round(eager_s, 5),
        "compiled_s": round(compiled_s, 5),
        "compile_s": round(max(0.0, times["compiled"][0] - compiled_s), 3),
    }


def valid(found: Any) -> bool:
    """A cached timing `choose` can read: three figures, or a recorded failure."""
    if not isinstance(found, dict):
        return False
    if isinstance(found.get("failed"), str):
        return True
    return all(
        isinstance(found.get(k), (int, float)) for k in ("eager_s", "compiled_s", "compile_s")
    )


def choose(found: dict[str, Any], calls: int) -> str:
    """The rule, applied to a timing of one call: compiled where it is MIN_GAIN faster and
    saves more over the run's `calls` than it costs to compile."""
    if "failed" in found or found["compiled_s"] <= 0:
        return "eager"
    gain = found["eager_s"] / found["compiled_s"]
    saves = (found["eager_s"] - found["compiled_s"]) * calls - found["compile_s"]
    return "compiled" if gain >= MIN_GAIN and saves > 0 else "eager"


def resolve(
    setting: str,
    value: str,
    calls: int,
    *,
    cache: str,
    key: Callable[[], str],
    measure: Callable[[], dict[str, Any]],
    compiler_missing: Callable[[], str],
    skipped: str = "",
    timed: bool = True,
) -> tuple[str, dict[str, Any] | None]:
    """(what `setting` stands for, what it was decided by): `value` unless 'auto', then the
    timing cached under `key()` (`cached` True where it was read, not run; `measure` where
    absent and `timed`), or why nothing was timed (`skipped`, set by the caller, or no compiler here).
    `timed` False (a plan): what a run here cached, if any. `compiled` set by hand where
    inductor cannot build is refused in one line."""
    if value == "compiled" and timed and (why := compiler_missing()):
        raise ConfigError(setting, f"compiled needs inductor: {why}; or set eager")
    if value != "auto":
        return value, None
    if skipped:
        return "eager", {"skipped": skipped}
    at = key()  # only now: a GPU's key reads the device, which a plan for one may not have
    found = peek(cache, at, valid=valid, provisional=not timed and follows_last_run())
    if found is not None:
        return choose(found, calls), found | {"cached": not measured_here(cache, at)}
    if not timed:
        return "eager", {"skipped": "a plan times nothing, and no run here has timed this shape"}
    if why := compiler_missing():
        return "eager", {"skipped": why}
    found = timed_cached(cache, at, measure, what=f"{setting} auto", valid=valid)
    return choose(found, calls), found | {"cached": False}


def missing_compiler(device: torch.device) -> str:
    """Why inductor cannot build kernels for `device` here ('' where it can): no C++ compiler
    on a CPU, no Triton on a GPU."""
    if device.type == "cuda":
        try:
            import triton  # noqa: F401
        except ImportError:
            return "Triton is not installed (pip install triton)"
        return ""
    if device.type != "cpu":
        return f"inductor builds no kernels for {device.type}"
    try:
        from torch._inductor.cpp_builder import get_cpp_compiler

        get_cpp_compiler()
    except Exception as e:  # noqa: BLE001 - any failure to find one means the same
        return f"no C++ compiler for inductor ({type(e).__name__}; install g++ or set CXX)"
    return ""
