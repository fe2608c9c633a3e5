"""How fast a CPU steps the optimizers the host tier may run: fused AdamW, SGD and torchao's
8-bit and 4-bit AdamW (and bitsandbytes' 8-bit AdamW where it is installed; onegpu does not
depend on it), in parameters per second, at this machine's thread count.

Why it matters: `memory.offload_optimizer` steps on the host CPU, so its step time is the
parameter count over this rate. The quantized steps are ~25x slower than fused AdamW here: an
8B model's 8-bit host step takes minutes on a CPU, which is why `memory.offload_states` keeps
the states on the host but steps on the device (docs/offload.md).

Usage: python benchmarks/host_step_rates.py [--out benchmarks/results/host-step-rates-DATE.md]
"""

from __future__ import annotations

import argparse
import datetime
import time
from pathlib import Path

import torch

from onegpu.perf.devices import cpu_name
from onegpu.quiet import library_notes_off


def _optimizer(name: str, p: torch.Tensor) -> torch.optim.Optimizer:
    if name == "adamw (fused)":
        return torch.optim.AdamW([p], lr=1e-3, fused=True)
    if name == "sgd (foreach, momentum)":
        return torch.optim.SGD([p], lr=1e-3, momentum=0.9, foreach=True)
    if name.startswith("bitsandbytes"):
        import bitsandbytes as bnb

        return bnb.optim.AdamW8bit([p], lr=1e-3, min_8bit_size=0)
    library_notes_off()
    from torchao.optim import AdamW4bit, AdamW8bit

    kind = AdamW8bit if "8-bit" in name else AdamW4bit
    return kind([p], lr=1e-3, bf16_stochastic_round=p.dtype == torch.bfloat16)


def rate(name: str, dtype: torch.dtype, numel: int = 1 << 24) -> tuple[float, float]:
    """(parameters/s, seconds of the first step: states made, the step compiled)."""
    p = torch.zeros(numel, dtype=dtype, requires_grad=True)
    p.grad = torch.randn(numel, dtype=dtype)
    opt = _optimizer(name, p)
    t0 = time.perf_counter()
    opt.step()
    first = time.perf_counter() - t0
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        opt.step()
        best = min(best, time.perf_counter() - t0)
    return numel / best, first


def _bf16_flags() -> str:
    """What `grep -o -E 'avx512_bf16|amx_bf16' /proc/cpuinfo` finds."""
    try:
        flags = set(Path("/proc/cpuinfo").read_text().split())
    except OSError:
        return "flags unknown"
    found = sorted(flags & {"avx512_bf16", "amx_bf16"})
    return ", ".join(found) or "neither avx512_bf16 nor amx_bf16"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    today = datetime.date.today().isoformat()
    ap.add_argument("--out", default=f"benchmarks/results/host-step-rates-{today}.md")
    args = ap.parse_args()
    names = ["adamw (fused)", "sgd (foreach, momentum)", "torchao 8-bit AdamW",
             "torchao 4-bit AdamW"]  # fmt: skip
    try:
        import bitsandbytes  # noqa: F401

        names.append("bitsandbytes 8-bit AdamW")
    except ImportError:
        pass
    rows = []
    for name in names:
        for dtype in (torch.float32, torch.bfloat16):
            r, first = rate(name, dtype)
            rows.append((name, str(dtype).removeprefix("torch."), r, first))
            print(f"{name:28s} {rows[-1][1]:9s} {r / 1e6:8.0f} M params/s", flush=True)
    threads = torch.get_num_threads()
    lines = [
        f"# Host optimizer steps on this CPU ({today})",
        "",
        f"Machine: {cpu_name()} ({_bf16_flags()}), {threads} threads, torch {torch.__version__}.",
        "Command: `python benchmarks/host_step_rates.py`. One tensor of 16M elements, best of "
        "5 steps after the first (which makes the states and compiles torchao's step).",
        "",
        "| optimizer | weights | M params/s | per thread | first step (s) | 8B step (s) |",
        "|---|---|---|---|---|---|",
    ]
    for name, dtype, r, first in rows:
        lines.append(
            f"| {name} | {dtype} | {r / 1e6:,.0f} | {r / threads / 1e6:,.0f} | {first:.1f} "
            f"| {8.03e9 / r:,.1f} |"
        )
    Path(args.out).write_text("\n".join(lines) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
