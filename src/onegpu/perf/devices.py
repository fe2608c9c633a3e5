"""Peak matmul rates: a table for common GPUs, a measurement for CPUs.

GPU figures are vendor datasheet peaks for dense tensor-core math (no sparsity), FLOP/s. A CPU's
peak is measured: a large matmul in the dtype, the best of several runs (another process on the
machine only ever lowers a run), cached under what sets the rate: the CPU's model name, the
instruction-set flags the kernels dispatch on, its clock where the kernel shows it, the thread
count and the torch version. Machines that report the same name ("AMD EPYC") differ 2x in
matmul rate here, so the name alone is not a key. `onegpu info` shows the figure and where it
came from; `onegpu info --refresh` measures again, and a run whose MFU reaches 100% refreshes it.
"""

from __future__ import annotations

import datetime
import os
import platform
import re
import time
from dataclasses import dataclass

import torch

from onegpu.cache import has
from onegpu.config import ConfigError
from onegpu.perf.contention import timed_cached
from onegpu.perf.cpu import RATE_FLAGS, hardware_key, read_cpuinfo  # noqa: F401 - RATE_FLAGS: API
from onegpu.perf.peaks import Peak

GiB = 2**30


@dataclass(frozen=True, slots=True)
class GPUSpec:
    name: str
    memory_bytes: int
    peak: dict[str, float]  # compute dtype name -> dense FLOP/s
    match: tuple[str, ...]  # substrings of torch.cuda.get_device_name()
    host_link: float = 0.0
    """The host link's datasheet rate per direction, bytes/s (PCIe x16: gen3 15.75 GB/s, gen4
    31.5, gen5 63): what offloaded gradients and weights cross every step."""
    capability: tuple[int, int] = (8, 0)
    """CUDA compute capability: sets the cuBLAS workspace torch gives each handle."""


PCIE = {3: 15.75e9, 4: 31.5e9, 5: 63e9}  # x16, per direction


def _spec(name, mem_gib, fp32, tf32, bf16, fp16, match, cc, pcie=4):
    peaks = {"fp32": fp32 * 1e12, "fp16": fp16 * 1e12}
    if tf32:
        peaks["tf32"] = tf32 * 1e12
    if bf16:
        peaks["bf16"] = bf16 * 1e12
    return GPUSpec(name, int(mem_gib * GiB), peaks, match, PCIE[pcie], cc)


GPUS: dict[str, GPUSpec] = {
    s.name: s
    for s in (
        _spec("T4", 16, 8.1, None, None, 65, ("T4",), (7, 5), pcie=3),
        _spec(
            "V100-16", 16, 15.7, None, None, 125, ("V100-SXM2-16", "V100-PCIE-16"), (7, 0), pcie=3
        ),
        _spec("V100-32", 32, 15.7, None, None, 125, ("V100",), (7, 0), pcie=3),
        _spec("A5000", 24, 27.8, 55.6, 111.1, 111.1, ("A5000",), (8, 6)),
        _spec("RTX3090", 24, 35.6, 35.6, 71, 71, ("3090",), (8, 6)),
        _spec("RTX4090", 24, 82.6, 82.6, 165.2, 165.2, ("4090",), (8, 9)),
        _spec("A10G", 24, 31.2, 35, 70, 70, ("A10G",), (8, 6)),
        _spec("L4", 24, 30.3, 60, 121, 121, ("L4",), (8, 9)),
        _spec(
            "A100-40", 40, 19.5, 156, 312, 312, ("A100-SXM4-40", "A100-PCIE-40", "A100 40"), (8, 0)
        ),
        _spec("A100-80", 80, 19.5, 156, 312, 312, ("A100",), (8, 0)),
        _spec("H100-80", 80, 66.9, 494.5, 989.4, 989.4, ("H100",), (9, 0), pcie=5),
        _spec("H200-141", 141, 66.9, 494.5, 989.4, 989.4, ("H200",), (9, 0), pcie=5),
    )
}


CUBLAS_HANDLES = 2
"""cuBLAS handles a training step holds: torch gives each thread its own, and on a GPU the
step's thread runs the forward and the optimizer while autograd's device thread runs backward."""


def cublas_workspace_bytes(capability: tuple[int, int]) -> int:
    """The workspace torch allocates for each cuBLAS handle, through the caching allocator (so
    `max_memory_allocated` counts it) and kept for the process's life; cuBLASLt shares it. As
    torch's CublasHandlePool.cpp sets it: CUBLAS_WORKSPACE_CONFIG (":SIZE_KIB:COUNT" pairs),
    else 32 MiB from compute capability 9 on (Hopper; Blackwell too since early 2026, 8 MiB +
    128 KiB in torch before that: this plans the larger) and 8 MiB + 128 KiB below."""
    pairs = re.findall(r":(\d+):(\d+)", os.environ.get("CUBLAS_WORKSPACE_CONFIG", ""))
    if pairs:
        return sum(int(size) * 1024 * int(count) for size, count in pairs)
    return 4096 * 8 * 1024 if capability >= (9, 0) else 4096 * 1024 * 2 + 16 * 1024 * 8


def gpu_spec_for(device_name: str) -> GPUSpec | None:
    """The table entry whose pattern matches a CUDA device name (most specific first)."""
    for spec in GPUS.values():  # "L4" must not match "L40S": no digit may follow a pattern
        if any(re.search(re.escape(pat) + r"(?!\d)", device_name) for pat in spec.match):
            return spec
    return None


def table_gpu(name: str) -> str:
    """The table's name for what a user wrote after --gpu: the name in any case, the model
    alone where one entry has it (h200 -> H200-141), or a CUDA device's name as nvidia-smi and
    torch give it (NVIDIA H100 80GB HBM3 -> H100-80)."""
    by_case = {k.lower(): k for k in GPUS}
    if name.lower() in by_case:
        return by_case[name.lower()]
    models = [k for k in GPUS if k.split("-")[0].lower() == name.lower()]
    if len(models) > 1:
        raise ConfigError("--gpu", f"{name!r} is one of {', '.join(models)}: name one")
    if models:
        return models[0]
    if " " in name and (spec := gpu_spec_for(name.upper())):  # a device's name, not a wrong size
        return _sized(name, spec.name)
    known_gpu(name)
    return name


def _sized(name: str, found: str) -> str:
    """The entry a device's name means where the table has several sizes of its model: the one
    whose memory the name says (NVIDIA A100-SXM4-80GB), else none (NVIDIA A100)."""
    model = found.split("-")[0]
    sizes = [k for k in GPUS if k.split("-")[0] == model]
    if len(sizes) == 1:
        return found
    said = [k for k in sizes if re.search(rf"(?<!\d){k.split('-')[1]}\s*GB", name, re.IGNORECASE)]
    if len(said) == 1:
        return said[0]
    raise ConfigError("--gpu", f"{name!r} is one of {', '.join(sizes)}: name one")


def known_gpu(name: str | None) -> None:
    """One line and exit 2 for a name that is not the table's (None: no GPU asked for)."""
    if name is not None and name not in GPUS:
        raise ConfigError(
            "--gpu", f"unknown GPU {name!r}; `onegpu plan --gpu list` shows the table"
        )


def cpu_name() -> str:
    return _cpuinfo().get("model name") or platform.processor() or platform.machine()


_cpuinfo = read_cpuinfo  # a module attribute: tests replace it


def cpu_identity() -> str:
    """What sets this CPU's matmul rate, as a cache key: model name, rate-relevant flags, the
    clock (perf/cpu.py), torch's kernel ISA and oneDNN's, where a variable caps it."""
    key = f"{hardware_key(_cpuinfo())}|{torch.backends.cpu.get_cpu_capability()}"
    onednn_cap = os.environ.get("ONEDNN_MAX_CPU_ISA") or os.environ.get("DNNL_MAX_CPU_ISA")
    return f"{key}|onednn<={onednn_cap.lower()}" if onednn_cap else key


def device_key(device: torch.device) -> str:
    """What a kernel timing on `device` depends on, as a cache key: the CPU's identity and
    thread count, or the GPU's name; and torch's version."""
    if device.type == "cuda":
        where = torch.cuda.get_device_name(device)
    elif device.type == "cpu":
        where = f"{cpu_identity()}|threads={torch.get_num_threads()}"
    else:
        where = device.type
    return f"{where}|torch={torch.__version__}"


def sync(device: torch.device) -> None:
    """Wait for `device`'s queued work (a no-op on a CPU, which runs eagerly): timings need it."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _time_mm(a: torch.Tensor, b: torch.Tensor, device: torch.device) -> float:
    sync(device)
    t0 = time.perf_counter()
    torch.mm(a, b)
    sync(device)
    return time.perf_counter() - t0


def measure_matmul_flops(
    dtype: torch.dtype, device: torch.device, n: int = 4096, repeats: int = 7, budget_s: float = 2.0
) -> float:
    """The best FLOP/s of `repeats` n x n x n matmuls in `dtype` on `device` (the best, not the
    median: a run can only be slowed by other work on a shared machine, never sped up).

    The size shrinks (by powers of two, down to 512) until one matmul takes at most budget_s:
    an emulated dtype (bf16 without AVX-512 BF16) runs ~100x slower than a native one, and a
    4096^3 product would then take minutes.
    """
    size = 512
    while True:
        a = torch.randn(size, size, device=device).to(dtype)
        b = torch.randn(size, size, device=device).to(dtype)
        torch.mm(a, b)  # warm-up: kernel selection, page faults
        t = _time_mm(a, b, device)
        if size >= n or t * 8 > budget_s:
            break
        size *= 2
    times = [_time_mm(a, b, device) for _ in range(repeats)]
    return 2 * size**3 / min(times)


def cpu_peak_key(dtype: torch.dtype) -> str:
    """What a CPU's measured peak depends on: the cache key of `cpu_peak_flops`."""
    return f"{cpu_identity()}|threads={torch.get_num_threads()}|torch={torch.__version__}|{dtype}"


@dataclass(frozen=True, slots=True)
class CpuPeak:
    flops: float
    key: str
    measured: str  # when (ISO date and time)


def cpu_peak(dtype: torch.dtype, *, refresh: bool = False, n: int = 4096) -> CpuPeak:
    """Measured matmul peak of this CPU in `dtype` (n x n x n), cached under `cpu_peak_key`."""

    def measure() -> dict[str, object]:
        flops = measure_matmul_flops(dtype, torch.device("cpu"), n=n)
        when = datetime.datetime.now().isoformat(timespec="seconds")
        return {"flops": flops, "measured": when}

    key = cpu_peak_key(dtype)
    entry = timed_cached(
        "cpu-peaks.json",
        key,
        measure,
        what=f"the CPU's {dtype} matmul peak",
        refresh=refresh,
        valid=has("flops", text=("measured",)),
    )
    return CpuPeak(float(entry["flops"]), key, str(entry["measured"]))


def cpu_peak_flops(dtype: torch.dtype, *, refresh: bool = False, n: int = 4096) -> float:
    return cpu_peak(dtype, refresh=refresh, n=n).flops


_DTYPE_KEY = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}


def peak_flops(device: torch.device, compute_dtype: torch.dtype, precision: str) -> Peak | None:
    """The peak to divide achieved FLOP/s by for MFU; None when unknown (MFU is then omitted)."""
    if device.type == "cpu":
        peak = cpu_peak(compute_dtype)
        return Peak(
            peak.flops,
            f"measured {_DTYPE_KEY[compute_dtype]} matmul (best of 7, {peak.measured}) on "
            f"{cpu_identity()}, {torch.get_num_threads()} threads",
        )
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        spec = gpu_spec_for(name)
        key = "tf32" if precision == "tf32" else _DTYPE_KEY[compute_dtype]
        if spec and key in spec.peak:
            return Peak(spec.peak[key], f"datasheet {key} dense peak of {spec.name}")
    return None
