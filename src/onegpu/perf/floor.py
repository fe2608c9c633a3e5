"""A step's matmul floor: the time its matrix products would take if nothing else ran.

Every GEMM of a step (`mm`, `addmm`, `bmm`, `baddbmm`, the fused `_addmm_activation`) and every
fused attention call is recorded as dispatched (`GemmRecorder`, a dispatch mode: fake tensors
are enough, so the trace costs no compute), then each distinct call is timed alone at its
shape, strides and dtype on this device (run back to back, the best of a few samples, cached
per device and fp32 matmul settings), and the times are summed. Attention counts as the batched products it does (forward QK^T and PV,
backward four), half of them where it is causal: its softmax is work the floor leaves out, like
every other non-matmul op.

The floor is what a step could take on this machine with every other cost gone; a step's
multiple of it (`step_over_floor`) is how far the run is from that (issue: "close to the
limit"). On a GPU the same calls are timed with the device synchronised around each sample.
"""

from __future__ import annotations

import time
import warnings
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from onegpu.cache import has, peek
from onegpu.perf.contention import disturbed_message, timed_cached
from onegpu.perf.devices import device_key, sync

GEMM_OPS = ("mm", "addmm", "bmm", "baddbmm", "_addmm_activation")
"""aten ops that are one matrix product (a bias add or GELU fused into it rides along)."""
FUSED_GEMMS = ("mkldnn::_linear_pointwise", "onegpu::linear_bias")
"""Other ops a profile shows that are one product (a compiled CPU linear: techniques/
bias_epilogue.py)."""
CACHE_FILE = "matmul-floor.json"
MIN_TIMED_S = 0.02  # each product runs until this much time is measured (at least 3 samples)
MIN_SAMPLE_S = 0.002  # a sample runs the product back to back for at least this long
TIMING_METHOD = 2
"""How products are timed (2: as the backend runs them, `runs_as`); in the cache key, so
products timed another way are timed again rather than read."""

Spec = tuple[tuple[int, ...], tuple[int, ...]]  # a tensor argument: (shape, strides)


@dataclass(frozen=True, slots=True)
class Gemm:
    """One matrix product of a step as the device runs it: the aten op, its tensor arguments'
    shapes and strides, the dtype; `share` the part of it the step needs (0.5 for causal
    attention's products) and `source` what made it ('matmul' or an attention op's name)."""

    op: str
    args: tuple[Spec, ...]
    dtype: torch.dtype
    share: float = 1.0
    source: str = "matmul"

    @property
    def flops(self) -> float:
        """2 m n k (times the batch for bmm), times `share`."""
        a, b = self.args[-2][0], self.args[-1][0]
        batch = a[0] if len(a) == 3 else 1
        return 2.0 * batch * a[-2] * a[-1] * b[-1] * self.share

    def key(self) -> str:
        shapes = ";".join(f"{list(s)}/{list(st)}" for s, st in self.args)
        return f"{self.op}|{str(self.dtype).removeprefix('torch.')}|{shapes}"


def _spec(t: torch.Tensor) -> Spec:
    return tuple(t.shape), tuple(t.stride())


def _named(func, args: tuple, kwargs: dict) -> dict[str, Any]:
    """The op's arguments by their schema names."""
    names = [a.name for a in func._schema.arguments]
    return {**dict(zip(names, args)), **kwargs}


def attention_products(func, args: tuple, kwargs: dict) -> list[Gemm]:
    """The batched products a fused attention call stands for: (B*H, T, D) x (B*H, D, S) and
    (B*H, T, S) x (B*H, S, D) forward; backward dP, dV, dQ and dK."""
    given = _named(func, args, kwargs)
    q, k = given.get("query"), given.get("key")
    if not isinstance(q, torch.Tensor) or not isinstance(k, torch.Tensor) or q.dim() != 4:
        return []
    heads = q.shape[0] * q.shape[1]
    t, s, d, dv = q.shape[2], k.shape[2], q.shape[3], given["value"].shape[3]
    share = 0.5 if given.get("is_causal") else 1.0
    name = str(func.overloadpacket).removeprefix("aten.")

    def bmm(m: int, k_: int, n: int) -> Gemm:
        a, b = (heads, m, k_), (heads, k_, n)
        specs = ((a, (m * k_, k_, 1)), (b, (k_ * n, n, 1)))
        return Gemm("bmm", specs, q.dtype, share, name)

    if name.endswith("_backward"):
        return [bmm(t, dv, s), bmm(s, t, dv), bmm(t, s, d), bmm(s, t, d)]
    return [bmm(t, d, s), bmm(t, s, dv)]


ATTENTION_NAMES = (
    "scaled_dot_product",
    "flash_attention",
    "efficient_attention",
    "cudnn_attention",
)
"""Substrings of the fused attention ops' names (CPU flash, CUDA flash / efficient / cuDNN)."""


def is_gemm_name(name: str) -> bool:
    """A profiled op that is one matrix product."""
    return name.removeprefix("aten::") in GEMM_OPS or name in FUSED_GEMMS


def is_attention_name(name: str) -> bool:
    return any(part in name for part in ATTENTION_NAMES)


def is_attention(func) -> bool:
    """A fused attention op as dispatched: its outer op (SDPA's choice of kernel), not the
    kernels it calls (`_flash_attention_forward`: same products, counted once)."""
    name = str(func.overloadpacket)
    return "scaled_dot_product" in name


class GemmRecorder(TorchDispatchMode):
    """Records the matrix products dispatched inside it (real or fake tensors alike)."""

    def __init__(self) -> None:
        super().__init__()
        self.gemms: list[Gemm] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = str(func.overloadpacket).removeprefix("aten.")
        if name in GEMM_OPS:
            mats = [a for a in args[:3] if isinstance(a, torch.Tensor)]
            op = "addmm" if name == "_addmm_activation" else name
            self.gemms.append(Gemm(op, tuple(_spec(m) for m in mats), mats[-1].dtype))
        elif is_attention(func):
            self.gemms.extend(attention_products(func, args, kwargs))
        return func(*args, **kwargs)


def operand(spec: Spec, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Random values laid out as `spec` (a transposed or broadcast operand stays one)."""
    shape, stride = spec
    extent = 1 + sum((n - 1) * s for n, s in zip(shape, stride)) if all(shape) else 0
    base = torch.randn(max(extent, 1), device=device).to(dtype)
    return base.as_strided(shape, stride)


RunsAs = Callable[[Callable, list[torch.Tensor]], tuple[Callable, list[torch.Tensor]]]
"""The kernel a backend runs a product with, and its arguments, given the aten op and its."""


def time_gemm(gemm: Gemm, device: torch.device, runs_as: RunsAs | None = None) -> float:
    """The best time of the whole product alone on `device`, in seconds: each sample runs it
    back to back until MIN_SAMPLE_S has passed (a GPU's launch and a CPU thread's wake-up are
    shared out, not charged to one call), the best of at least 3 samples. `runs_as`: the
    product is timed as the backend's fastest exact kernel runs it (a CPU linear's bias added in
    oneDNN's epilogue: copying it into the output first is not product work)."""
    args = [operand(s, gemm.dtype, device) for s in gemm.args]
    op = getattr(torch.ops.aten, gemm.op)
    if runs_as is not None:
        op, args = runs_as(op, args)
    op(*args)  # warm-up: kernel choice, page faults
    sync(device)
    t0 = time.perf_counter()
    op(*args)
    sync(device)
    once = time.perf_counter() - t0
    calls = max(1, min(1000, int(MIN_SAMPLE_S / max(once, 1e-7))))
    samples = [once] if calls == 1 else []  # a long product: this run is a sample already
    while len(samples) < 3 or (sum(samples) * calls < MIN_TIMED_S and len(samples) < 50):
        sync(device)
        t0 = time.perf_counter()
        for _ in range(calls):
            op(*args)
        sync(device)
        samples.append((time.perf_counter() - t0) / calls)
    return min(samples)


@dataclass(frozen=True, slots=True)
class Floor:
    """A step's matmul floor: the seconds its products take alone, and each call's part."""

    seconds: float
    flops: float
    calls: list[tuple[Gemm, int, float]]  # (call, times per step, seconds each)

    def by_source(self) -> dict[str, float]:
        """Seconds per source ('matmul', each attention op)."""
        out: Counter[str] = Counter()
        for gemm, n, s in self.calls:
            out[gemm.source] += n * s
        return dict(out)

    def largest(self, top: int = 6) -> list[str]:
        """The products that take the most of the floor, a line each with their rate alone:
        where the products themselves fall short of the device (a transposed operand, a thin
        shape), which no cut of the non-matmul work reaches."""
        lines = []
        for gemm, n, s in sorted(self.calls, key=lambda c: -c[1] * c[2])[:top]:
            operands = " x ".join(_layout(shape, stride) for shape, stride in gemm.args[-2:])
            lines.append(
                f"    {n * s * 1e3:7.1f} ms  {n:3d} x {gemm.op} {operands}  "
                f"{gemm.flops / s / 1e9:,.0f} GFLOP/s"
            )
        return lines


def _layout(shape: tuple[int, ...], stride: tuple[int, ...]) -> str:
    """`[384x4096]` as laid out, `[384x4096]^T` for a transposed view of a contiguous tensor."""
    dims = "x".join(map(str, shape))
    transposed = len(shape) >= 2 and stride[-2] == 1 and shape[-2] > 1 and shape[-1] > 1
    return f"[{dims}]{'^T' if transposed else ''}"


def timing_key(device: torch.device) -> str:
    """What a product's time depends on beyond its shape: the device (identity, threads, torch
    version) and the fp32 matmul settings a precision policy switches (TF32 on a GPU, oneDNN's
    reduced-precision fp32 on a CPU)."""
    tf32 = torch.backends.cuda.matmul.allow_tf32 if device.type == "cuda" else False
    fp32 = torch.get_float32_matmul_precision()
    return f"{device_key(device)}|tf32={tf32}|fp32_matmul={fp32}|method={TIMING_METHOD}"


def matmul_floor(
    gemms: list[Gemm],
    device: torch.device,
    repeat: int = 1,
    *,
    refresh: bool = False,
    runs_as: RunsAs | None = None,
) -> Floor:
    """Sum of each recorded product's time alone (distinct calls timed once, cached per
    device and settings; `refresh` times them again and keeps the faster), for a step that
    runs the recorded ones `repeat` times (its micro-batches)."""
    counts = Counter(gemms)
    calls: list[tuple[Gemm, int, float]] = []
    disturbed: list[float] = []
    for gemm, n in counts.items():
        key = f"{timing_key(device)}|{gemm.key()}"
        stored = peek(CACHE_FILE, key, has("seconds")) if refresh else None

        def measure(g: Gemm = gemm, stored: dict | None = stored) -> dict[str, float]:
            seconds = time_gemm(g, device, runs_as)
            # the least a product has been seen to take: a refresh that caught a slow moment
            # of a shared machine does not raise the floor
            return {"seconds": min(seconds, stored["seconds"]) if stored else seconds}

        entry = timed_cached(
            CACHE_FILE,
            key,
            measure,
            what="the matmul floor",
            refresh=refresh,
            valid=has("seconds"),
            on_disturbed=disturbed.append,
            keeps_stored=True,  # the stored time stays the floor's until a faster one is seen
        )
        seconds = float(entry["seconds"]) * gemm.share
        calls.append((gemm, n * repeat, seconds))
    if disturbed:
        what = f"the matmul floor ({len(disturbed)} of its {len(counts)} products)"
        warnings.warn(disturbed_message(what, CACHE_FILE, max(disturbed)), stacklevel=2)
    total = sum(n * s for _, n, s in calls)
    return Floor(total, sum(g.flops * n for g, n, _ in calls), calls)
