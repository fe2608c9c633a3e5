"""What a CPU is, for cache keys of its measured rates, without torch (the JAX backend reads
the peak `onegpu info` measured through the same key)."""

from __future__ import annotations

import platform
from pathlib import Path

# CPU flags that change which matmul kernel runs (vector width, 16-bit dot products, AMX tiles)
RATE_FLAGS = (
    "avx2",
    "fma",
    "avx512f",
    "avx512_bf16",
    "avx512_fp16",
    "avx512_vnni",
    "amx_bf16",
    "amx_tile",
    "asimd",
    "sve",
    "sve2",
    "bf16",
    "i8mm",
)


def read_cpuinfo() -> dict[str, str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return {}
    info: dict[str, str] = {}
    for line in text.splitlines():
        key, _, value = line.partition(":")
        info.setdefault(key.strip(), value.strip())
    return info


def hardware_key(info: dict[str, str]) -> str:
    """Model name, rate-relevant flags and the clock (/sys's maximum, else /proc's current, to
    100 MHz): the part of a CPU's rate key that needs no framework."""
    name = info.get("model name") or platform.processor() or platform.machine()
    flags = set((info.get("flags") or info.get("Features") or "").split())
    mhz = None
    try:
        khz = Path("/sys/devices/system/cpu/cpu0/cpufreq/cpuinfo_max_freq").read_text()
        mhz = int(khz) // 1000
    except (OSError, ValueError):
        if info.get("cpu MHz"):
            mhz = float(info["cpu MHz"])
    clock = f"{round(mhz / 100) / 10:.1f}GHz" if mhz else "clock?"
    have = "+".join(f for f in RATE_FLAGS if f in flags) or "flags?"
    return f"{name}|{have}|{clock}"
