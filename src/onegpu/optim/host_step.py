"""How fast this CPU steps an optimizer: the host half of an offloaded step, measured once and
cached like the matmul peak (under the same key: CPU, rate flags, clock, threads, torch).

An offloaded optimizer (memory.offload_optimizer, memory.offload_params) runs its step on the
CPU over every parameter: fused AdamW steps over a billion parameters a second on two cores,
torchao's 8-bit AdamW about 30 million a core (its quantization looks every moment up in a
256-entry code book), so the planner measures the optimizer it is asked about. A plan for
another machine names its CPU count (`onegpu plan --host-cpus N`): the rate is scaled by
N / this machine's threads, which assumes the step parallelises and memory bandwidth keeps up
(labelled as such).
"""

from __future__ import annotations

import contextlib
import contextvars
import datetime
import time
from collections.abc import Iterator

import torch
from torch import nn

from onegpu.cache import has
from onegpu.perf.contention import timed_cached
from onegpu.perf.devices import cpu_peak_key

MEASURED = ("adamw", "sgd", "adamw8bit", "adamw4bit")
"""Optimizers timed as themselves; the others are planned at AdamW's rate (labelled)."""

_HOST_CPUS: contextvars.ContextVar[int | None] = contextvars.ContextVar(
    "onegpu_host_cpus", default=None
)


@contextlib.contextmanager
def priced_for(host_cpus: int | None) -> Iterator[None]:
    """Host steps planned inside are priced for a CPU of `host_cpus` cores (None: this one)."""
    token = _HOST_CPUS.set(host_cpus)
    try:
        yield
    finally:
        _HOST_CPUS.reset(token)


def _optimizer(name: str, p: torch.Tensor) -> torch.optim.Optimizer:
    """`name` over `p` exactly as the host tier builds it for weights of `p`'s dtype (bf16:
    Kahan-compensated AdamW/SGD, torchao's stochastic rounding)."""
    from onegpu.config import OptimConfig
    from onegpu.optim.factory import build_optimizer
    from onegpu.quiet import library_notes_off

    library_notes_off()
    holder = nn.Module()
    holder.weight = nn.Parameter(p)
    cfg = OptimConfig(name=name)  # type: ignore[arg-type]
    return build_optimizer(holder, cfg, torch.device("cpu"), param_dtype=p.dtype)


def _measure(name: str, dtype: torch.dtype) -> float:
    """Parameters per second of a CPU step of `name` over one tensor of `dtype` (best of 5; the
    low-bit steps, compiled by torchao, over a smaller one)."""
    rows = 1 << 14 if name in ("adamw", "sgd") else 1 << 12  # x 1,024: a matmul weight
    p = torch.zeros(rows, 1024, dtype=dtype)
    opt = _optimizer(name, p)
    p = opt.param_groups[0]["params"][0]
    p.grad = torch.randn_like(p)
    numel = p.numel()
    opt.step()  # states allocated (and the low-bit step compiled)
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        opt.step()
        best = min(best, time.perf_counter() - t0)
    return numel / best


def _measurable(optimizer: str) -> str:
    """The optimizer timed for `optimizer`: itself where it can be, else AdamW."""
    if optimizer not in MEASURED:
        return "adamw"
    if optimizer in ("adamw8bit", "adamw4bit"):
        try:
            import torchao.optim  # noqa: F401
        except ImportError:
            return "adamw"
    return optimizer


def host_step_rate(
    optimizer: str, dtype: torch.dtype = torch.float32, *, refresh: bool = False
) -> tuple[float, str]:
    """(parameters/s of the host CPU's optimizer step over weights of `dtype`, how it was
    obtained), measured here once (cached), scaled to the CPU count `priced_for` names. The
    dtype matters: torchao's 8-bit step over bf16 weights runs at 0.7x its fp32 rate."""
    name = _measurable(optimizer)

    def measure() -> dict[str, object]:
        when = datetime.datetime.now().isoformat(timespec="seconds")
        return {"params_per_s": _measure(name, dtype), "measured": when}

    entry = timed_cached(
        "host-step.json",
        f"{cpu_peak_key(dtype)}|{name}",
        measure,
        what=f"the host's {name} step",
        refresh=refresh,
        valid=has("params_per_s", text=("measured",)),
    )
    rate = float(entry["params_per_s"])
    threads = torch.get_num_threads()
    weights = str(dtype).removeprefix("torch.")
    how = f"measured {name} step over {weights} weights on this CPU, {threads} threads"
    how += f" ({entry['measured']})"
    if name != optimizer:
        how += f"; {optimizer} planned at AdamW's rate"
    cpus = _HOST_CPUS.get()
    if cpus:
        rate *= cpus / threads
        how += f"; scaled to {cpus} host cores (linear: assumes memory bandwidth keeps up)"
    return rate, how
