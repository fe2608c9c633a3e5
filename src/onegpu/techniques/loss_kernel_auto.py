"""`train.loss_kernel auto`: the chunked loss timed with ATen's kernels and with the compiled
ones (techniques/loss_kernels.py) once per shape, device and allocator (cached,
`loss_kernel.json`); compiled where the saving over the run's micro-batches outweighs the
compile time."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch

from onegpu.perf.allocator import active_allocator
from onegpu.perf.devices import device_key, sync
from onegpu.techniques.chunked_loss import ChunkedLinearCrossEntropy
from onegpu.techniques.kernel_trial import MIN_MICRO_BATCHES as MIN_STEPS
from onegpu.techniques.kernel_trial import missing_compiler, resolve, time_both
from onegpu.techniques.loss_kernels import LossKernels, compiled_kernels

CACHE = "loss_kernel.json"
KERNELS = 2
"""What `compiled` runs, in the cache key: 2 since a CPU's softmax gradient is the C++ kernel's
(loss_kernel_cpu.py), so timings of inductor's are made again."""


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
            f"|chunk={self.chunk}|kernels={KERNELS}"
        )


def measure_loss_kernel(shape: LossShape, device: torch.device) -> dict[str, Any]:
    """The chunked loss's forward + backward on random inputs of `shape`, eager and compiled
    (kernel_trial.time_both)."""
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

    return time_both(lambda compiled: run(compiled_kernels() if compiled else None))


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
    if value == "auto" and not shape.chunk:
        return "eager", None
    return resolve(
        "train.loss_kernel",
        value,
        micro_steps,
        cache=CACHE,
        key=lambda: shape.key(device),
        measure=lambda: measure_loss_kernel(shape, device),
        compiler_missing=lambda: missing_compiler(device),
        skipped=_not_timed(shape, micro_steps, fusable),
        timed=timed,
    )


def _not_timed(shape: LossShape, micro_steps: int, fusable: bool) -> str:
    """Why `auto` keeps ATen's kernels without timing ('' where it times)."""
    if not fusable:
        return "a vocabulary split over processes, or a head with a bias"
    if micro_steps < MIN_STEPS:
        return f"a run of {micro_steps} micro-batches, under {MIN_STEPS}"
    return ""
