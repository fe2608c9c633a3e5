"""`train.loss_kernel auto`: the chunked loss timed with ATen's kernels and with the compiled
ones (techniques/loss_kernels.py) once per shape, device and allocator (cached,
`loss_kernel.json`); compiled where the saving over the run's micro-batches outweighs the
compile time."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch
from torch._dynamo.exc import BackendCompilerFailed

from onegpu.cache import peek
from onegpu.config import ConfigError
from onegpu.perf.allocator import active_allocator
from onegpu.perf.contention import follows_last_run, measured_here, timed_cached
from onegpu.perf.devices import device_key, sync
from onegpu.techniques.chunked_loss import ChunkedLinearCrossEntropy
from onegpu.techniques.loss_kernels import LossKernels, compiled_kernels, missing_compiler

MIN_STEPS = 100
"""Runs of fewer micro-batches keep the eager kernels without timing: a first compile of the two
kernels costs seconds that a short run does not win back."""
MIN_GAIN = 1.02
"""The compiled kernels are kept only where the chunked loss runs at least this much faster
(two timings of one kernel differ by about 1%)."""
CACHE = "loss_kernel.json"
ROUNDS = 4
"""Timed rounds, eager and compiled interleaved; the first warms up (the compiled one compiles)."""


@dataclass(frozen=True, slots=True)
class LossShape:
    """The chunked loss one micro-batch runs: what its timing depends on."""

    tokens: int
    d_model: int
    vocab: int  # the output layer's rows, padding included
    n_valid: int  # the vocabulary's own size: columns from it on are padding
    chunk: int
    compute_dtype: torch.dtype
    param_dtype: torch.dtype  # the hidden states' and the output weight's (fp32 under autocast)

    def key(self, device: torch.device) -> str:
        return (
            f"{device_key(device)}|{active_allocator()}|{self.compute_dtype}|{self.param_dtype}"
            f"|tokens={self.tokens}|d={self.d_model}|vocab={self.vocab}|valid={self.n_valid}"
            f"|chunk={self.chunk}"
        )


def measure_loss_kernel(shape: LossShape, device: torch.device) -> dict[str, Any]:
    """The chunked loss's forward + backward on random inputs of `shape`, eager and compiled,
    interleaved: each one's minimum after the first round; the compiled first round's excess is
    the compile time. A compile that fails (no C++ compiler, say) is recorded as such."""
    g = torch.Generator(device="cpu").manual_seed(0)
    h_ND = torch.randn(shape.tokens, shape.d_model, generator=g)
    w_VD = torch.randn(shape.vocab, shape.d_model, generator=g) * 0.02
    h_ND = h_ND.to(device, shape.param_dtype).requires_grad_()
    w_VD = w_VD.to(device, shape.param_dtype).requires_grad_()
    t_N = torch.randint(0, shape.n_valid, (shape.tokens,), generator=g).to(device)

    def run(kernels: LossKernels | None) -> float:
        sync(device)
        t0 = time.perf_counter()
        ChunkedLinearCrossEntropy.apply(
            h_ND, w_VD, None, t_N, shape.chunk, shape.compute_dtype, shape.n_valid, None, kernels
        ).backward()
        sync(device)
        h_ND.grad = w_VD.grad = None
        return time.perf_counter() - t0

    times: dict[str, list[float]] = {"eager": [], "compiled": []}
    for _ in range(ROUNDS):
        times["eager"].append(run(None))
        try:
            times["compiled"].append(run(compiled_kernels()))
        except BackendCompilerFailed as e:  # inductor could not build them: stay eager
            first = (str(e).splitlines() or [""])[0]
            return {"failed": f"{type(e).__name__}: {first[:200]}"}
    eager_s, compiled_s = min(times["eager"][1:]), min(times["compiled"][1:])
    return {
        "eager_s": round(eager_s, 5),
        "compiled_s": round(compiled_s, 5),
        "compile_s": round(max(0.0, times["compiled"][0] - compiled_s), 3),
    }


def _valid(found: Any) -> bool:
    if not isinstance(found, dict):
        return False
    if isinstance(found.get("failed"), str):
        return True
    return all(
        isinstance(found.get(k), (int, float)) for k in ("eager_s", "compiled_s", "compile_s")
    )


def choose(found: dict[str, Any], micro_steps: int) -> str:
    """The rule, applied to a timing: compiled where it is MIN_GAIN faster and saves more over
    the run than it costs to compile."""
    if "failed" in found or found["compiled_s"] <= 0:
        return "eager"
    gain = found["eager_s"] / found["compiled_s"]
    saves = (found["eager_s"] - found["compiled_s"]) * micro_steps - found["compile_s"]
    return "compiled" if gain >= MIN_GAIN and saves > 0 else "eager"


def resolve_loss_kernel(
    value: str,
    shape: LossShape,
    device: torch.device,
    micro_steps: int,
    *,
    fusable: bool = True,
    timed: bool = True,
) -> tuple[str, dict[str, Any] | None]:
    """(what `train.loss_kernel` stands for, what it was decided by): itself unless 'auto',
    then the timing (`cached` True where it was read, not run), or why nothing was timed
    (`skipped`), or None where the loss is not chunked. `fusable`: the chunked loss runs on one
    process's whole vocabulary with no bias (a vocabulary-sharded loss keeps ATen's kernels
    between its all-reduces; the fused kernel takes no bias). `timed` False (a plan): what a
    run here cached, if any."""
    if value == "compiled" and timed and (why := missing_compiler(device)):
        raise ConfigError("train.loss_kernel", f"compiled needs inductor: {why}; or set eager")
    if value != "auto":
        return value, None
    if not shape.chunk:
        return "eager", None
    if why := _not_timed(shape, micro_steps, fusable):
        return "eager", {"skipped": why}
    key = shape.key(device)
    found = peek(CACHE, key, valid=_valid, provisional=not timed and follows_last_run())
    if found is not None:
        return choose(found, micro_steps), found | {"cached": not measured_here(CACHE, key)}
    if not timed:
        return "eager", {"skipped": "a plan times nothing, and no run here has timed this shape"}
    if why := missing_compiler(device):
        return "eager", {"skipped": why}
    found = timed_cached(
        CACHE,
        key,
        lambda: measure_loss_kernel(shape, device),
        what="the loss kernels (train.loss_kernel auto)",
        valid=_valid,
    )
    return choose(found, micro_steps), found | {"cached": False}


def _not_timed(shape: LossShape, micro_steps: int, fusable: bool) -> str:
    """Why `auto` keeps ATen's kernels without timing ('' where it times)."""
    if not fusable:
        return "a vocabulary split over processes, or a head with a bias"
    if micro_steps < MIN_STEPS:
        return f"a run of {micro_steps} micro-batches, under {MIN_STEPS}"
    return ""
