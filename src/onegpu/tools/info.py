"""`onegpu info`: what this machine can run, how fast its matmuls are, and which `auto`
choices it has timed (docs/auto-defaults.md)."""

from __future__ import annotations

from typing import Any

import torch

from onegpu.cache import cache_root, entries
from onegpu.perf.devices import (
    cpu_identity,
    cpu_name,
    cpu_peak,
    gpu_spec_for,
    measure_matmul_flops,
)
from onegpu.techniques.precision import (
    CPU_BF16_MARGIN,
    DeviceCaps,
    auto_takes_bf16,
    bf16_native,
    tf32_capable,
)

CPU_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
AUTO_CACHES = {
    "attention": "attention.json",
    "loss chunk": "loss_chunk.json",
    "loss kernel": "loss_kernel.json",
    "GELU kernel": "gelu_kernel.json",
    "compile": "compile.json",
}


def cached_choices() -> dict[str, int]:
    """How many timed `auto` choices each cache file holds (shapes x devices x versions)."""
    return {what: len(entries(name)) for what, name in AUTO_CACHES.items()}


def _precisions(device: torch.device) -> dict[str, str]:
    bf16 = (
        "native" if bf16_native(device) else ("emulated (slow)" if device.type == "cpu" else "no")
    )
    return {
        "fp32": "yes",
        "tf32": "yes" if tf32_capable(device) else "no (needs CUDA compute capability 8.0+)",
        "bf16": bf16,
        "fp16": "yes (autocast + loss scaling)" if device.type != "mps" else "no",
    }


def _cpu_auto_precision(peaks: dict[str, float]) -> str:
    """What `train.precision auto` takes on this CPU, and why (techniques/precision.py)."""
    if not bf16_native(torch.device("cpu")):
        return "fp32 (bf16 is emulated here)"
    speedup = peaks["bf16"] / peaks["fp32"]
    caps = DeviceCaps("cpu", bf16=True, tf32=False, bf16_speedup=speedup)
    chosen = "bf16" if auto_takes_bf16(caps) else "fp32"
    return f"{chosen} (bf16 matmuls {speedup:.2f}x fp32's; bf16 needs {CPU_BF16_MARGIN}x)"


def device_info(measure: bool = True, refresh: bool = False) -> dict[str, Any]:
    """This machine's devices; `measure`: the CPU's matmul peaks (cached, measured when absent
    or when `refresh`) and each GPU's measured rate."""
    devices: list[dict[str, Any]] = []
    cpu = torch.device("cpu")
    entry: dict[str, Any] = {
        "device": "cpu",
        "name": cpu_name(),
        "threads": torch.get_num_threads(),
        "isa": torch.backends.cpu.get_cpu_capability(),
        "precisions": _precisions(cpu),
    }
    entry["rate_key"] = cpu_identity()
    if measure:
        peaks = {k: cpu_peak(dt, refresh=refresh) for k, dt in CPU_DTYPES.items()}
        entry["matmul_peak_flops"] = {k: p.flops for k, p in peaks.items()}
        entry["matmul_peak_source"] = {
            k: f"measured {p.measured} (best of 7), cached under {p.key}" for k, p in peaks.items()
        }
        entry["auto_precision"] = _cpu_auto_precision(entry["matmul_peak_flops"])
    devices.append(entry)
    for i in range(torch.cuda.device_count()):
        dev = torch.device("cuda", i)
        props = torch.cuda.get_device_properties(dev)
        spec = gpu_spec_for(props.name)
        entry = {
            "device": str(dev),
            "name": props.name,
            "memory_bytes": props.total_memory,
            "compute_capability": f"{props.major}.{props.minor}",
            "precisions": _precisions(dev),
            "table_entry": spec.name if spec else None,
            "datasheet_peak_flops": spec.peak if spec else None,
        }
        if measure:
            entry["matmul_peak_flops"] = {
                "fp32": measure_matmul_flops(torch.float32, dev, n=8192),
                "bf16": measure_matmul_flops(torch.bfloat16, dev, n=8192)
                if bf16_native(dev)
                else None,
            }
        devices.append(entry)
    return {
        "torch": torch.__version__,
        "cuda_available": torch.cuda.is_available(),
        "mps_available": torch.backends.mps.is_available(),
        "devices": devices,
        "cache_dir": str(cache_root()),
        "auto_choices_cached": cached_choices(),
    }


def format_info(info: dict[str, Any]) -> str:
    lines = [f"torch {info['torch']}  cuda={info['cuda_available']}  mps={info['mps_available']}"]
    for d in info["devices"]:
        lines.append(f"\n{d['device']}: {d['name']}")
        for k in (
            "threads",
            "isa",
            "memory_bytes",
            "compute_capability",
            "table_entry",
            "auto_precision",
        ):
            if d.get(k) is not None:
                lines.append(f"  {k}: {d[k]}")
        lines.append("  precisions: " + ", ".join(f"{k}={v}" for k, v in d["precisions"].items()))
        if d.get("rate_key"):
            lines.append(f"  rate key: {d['rate_key']}")
        for k, v in (d.get("matmul_peak_flops") or {}).items():
            if v is not None:
                lines.append(f"  measured {k} matmul peak: {v / 1e9:,.0f} GFLOP/s")
                if k in d.get("matmul_peak_source", {}):
                    lines.append(f"    ({d['matmul_peak_source'][k]})")
        for k, v in (d.get("datasheet_peak_flops") or {}).items():
            lines.append(f"  datasheet {k} peak: {v / 1e12:,.1f} TFLOP/s")
    if "auto_choices_cached" in info:
        counts = ", ".join(f"{k} {v}" for k, v in info["auto_choices_cached"].items())
        lines.append(f"\nauto choices timed and cached in {info['cache_dir']}: {counts}")
        lines.append("  (docs/auto-defaults.md; delete a file there to time again)")
    return "\n".join(lines)
