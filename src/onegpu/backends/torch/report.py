"""What a torch run says: the header line, its fields of summary.json, the per-process summary
under torchrun, and the MFU denominator (its re-check on a CPU)."""

from __future__ import annotations

import dataclasses
import warnings
from pathlib import Path
from typing import Any

import torch

from onegpu.backends.torch.build import Built
from onegpu.config import to_dict
from onegpu.config.layout import bubble
from onegpu.distributed import compression
from onegpu.distributed.parallelize import local_tensor
from onegpu.memory.measure import peak_bytes, peak_kind
from onegpu.optim.state_bytes import optimizer_state_bytes
from onegpu.perf.allocator import active_allocator
from onegpu.perf.devices import Peak, peak_flops
from onegpu.runs.folder import environment
from onegpu.techniques.compile_auto import CompileTrial


def run_peak(built: Built) -> Peak | None:
    """The peak FLOP/s MFU is measured against: this device's, times the processes."""
    peak = peak_flops(built.device, built.policy.compute_dtype, built.policy.name)
    n = built.dist.world_size
    if peak and n > 1:
        peak = dataclasses.replace(peak, flops=peak.flops * n, source=f"{peak.source} x {n}")
    return peak


def torch_environment() -> dict[str, Any]:
    """The framework's part of environment(): versions, threads, the host allocator."""
    return environment(
        torch=torch.__version__, threads=torch.get_num_threads(), allocator=active_allocator()
    )


def trials_compile_s(trial: CompileTrial | None) -> float:
    """What `auto`'s trials spent compiling in this run, every mode timed (cached ones cost
    nothing), whichever was chosen: the run paid it."""
    if trial is None or trial.skipped:
        return 0.0
    return sum(t.compile_s for t in (trial, *trial.others) if not t.cached)


def describe(built: Built, out_dir: Path, start: int) -> str:
    cfg, ctx = built.cfg, built.dist
    resumed = f" | resumed at step {start}" if start else ""
    where = f"{built.device}"
    micro = f"{built.step.n_micro} micro-batch(es)"
    if ctx.enabled:
        how = ctx.layout.describe() if ctx.mesh is not None else ctx.strategy
        where = f"{how} over {ctx.world_size} processes ({ctx.backend}, {built.device.type})"
        micro = f"{ctx.dp_size} data-parallel x {micro} of {cfg.train.micro_batch_size}"
    return (
        f"onegpu: {built.n_params:,} parameters | {where} | {built.policy.name} | "
        f"batch {cfg.train.batch_size}x{cfg.train_seq_len} tokens in {micro} | "
        f"{describe_auto(built)}data {built.data.description}{built.data.rows_note()} | run folder {out_dir}{resumed}"
    )


def describe_auto(built: Built) -> str:
    """What the `auto` attention, loss chunk, loss kernel and compile chose ('' where none was
    auto)."""
    cfg, parts = built.cfg, []
    if record := built.resolved.precision_auto:
        parts.append(
            f"precision {cfg.train.precision} (bf16 matmuls {record['bf16_speedup']:.2f}x fp32's)"
        )
    if timing := built.resolved.attention_timing:
        said = describe_attention_timing(timing)
        if cfg.model.attention != built.resolved.attention:  # compile auto stayed eager
            said += f"; the run stays eager: {cfg.model.attention}, which keeps less"
        parts.append(f"attention {cfg.model.attention} ({said})")
    if built.asked and built.asked.memory.loss_chunk == "auto":
        parts.append(f"loss chunk {cfg.memory.loss_chunk or 'off'}")
    if timing := built.resolved.loss_kernel_timing:
        loss = describe_kernel_timing(timing, "a micro-batch's loss")
        parts.append(f"loss kernel {cfg.train.loss_kernel} ({loss})")
    if timing := built.resolved.gelu_kernel_timing:
        gelu = describe_kernel_timing(timing, "a layer's GELU forward + backward")
        parts.append(f"GELU kernel {cfg.train.gelu_kernel} ({gelu})")
    if (trial := built.compile_trial) and trial.skipped:
        parts.append(f"compile none (not timed: {trial.skipped})")
    elif trial:
        trials = (trial, *trial.others)
        eager_s = min(t.eager_s for t in trials)  # what the choice weighed every mode on
        timed = ", ".join(
            f"{t.mode} {t.compiled_at(eager_s) * 1e3:,.0f} ms"
            + (" (cached)" if t.cached else f" (+{t.compile_s:.0f} s to compile)")
            for t in trials
        )
        parts.append(
            f"compile {cfg.train.compile} over {built.step.n_micro * cfg.train.max_steps} "
            f"micro-batches (a micro-batch: eager {eager_s * 1e3:,.0f} ms, {timed})"
        )
    return "auto: " + ", ".join(parts) + " | " if parts else ""


def describe_attention_timing(timing: dict[str, Any]) -> str:
    """The candidates' times, as the first line shows them."""
    times = ", ".join(f"{name} {ms:,.1f} ms" for name, ms in timing["ms"].items())
    how = " compiled" if timing.get("compiled") else ""
    return f"a layer's forward + backward{how}: {times}{', cached' if timing.get('cached') else ''}"


def kernel_record(timing: dict[str, Any] | None, chosen: str) -> dict[str, Any] | None:
    """summary.json's record of a kernel's `auto` (`train.loss_kernel`, `train.gelu_kernel`):
    its timing, or why none, and its choice (None: not auto)."""
    return timing | {"chosen": chosen} if timing else None


def describe_kernel_timing(timing: dict[str, Any], what: str) -> str:
    """A kernel's timing, eager against compiled (of `what`), as the first line shows it."""
    if "skipped" in timing:
        return f"not timed: {timing['skipped']}"
    if "failed" in timing:
        return f"compile failed: {timing['failed']}"
    compile_ = "cached" if timing.get("cached") else f"+{timing['compile_s']:.1f} s to compile"
    return (
        f"{what}: eager {_ms(timing['eager_s'])} ms, compiled {_ms(timing['compiled_s'])} ms, "
        f"{compile_}"
    )


def _ms(seconds: float) -> str:
    """Milliseconds to three significant figures or so: a GELU's few ms, a loss's hundreds."""
    ms = seconds * 1e3
    return f"{ms:,.0f}" if ms >= 100 else f"{ms:.1f}" if ms >= 10 else f"{ms:.2f}"


def run_floor(built: Built, step_s: float | None) -> float | None:
    """The step's matmul floor in seconds (perf/floor.py), checked against the measured step
    `step_s`; None over several processes (each runs a share) or where the model cannot be
    traced on fake tensors (a step that reads a value, as randomized layers do): a finished
    run's summary never fails for it."""
    if built.dist.world_size > 1 or built.device.type not in ("cpu", "cuda"):
        return None
    from torch._subclasses.fake_tensor import DataDependentOutputException

    from onegpu.backends.torch.floor import checked_floor

    try:
        floor = checked_floor(built.cfg, built.device, step_s).seconds
    except DataDependentOutputException:  # a value read in the step (randomized layers): the
        return None  # start-up memory check said so already; fake tensors cannot follow it
    except Exception as e:  # noqa: BLE001 - a measurement beside the run, never its failure
        warnings.warn(f"matmul floor not measured: {type(e).__name__}: {e}", stacklevel=1)
        return None
    if step_s is not None and floor > step_s:
        warnings.warn(
            f"the matmul floor ({floor * 1e3:,.1f} ms) exceeds the measured step "
            f"({step_s * 1e3:,.1f} ms) even timed again: another process was likely running",
            stacklevel=1,
        )
    return floor


def torch_summary(
    built: Built, memory: dict[str, Any], step_s: float | None, *, interrupted: bool = False
) -> dict[str, Any]:
    """The torch backend's fields of summary.json: memory, device, versions, compilation, the
    step's matmul floor (not after a signal: a stopped run writes its summary at once)."""
    cfg, device, r = built.cfg, built.device, built.resolved
    compiled = cfg.train.compile != "none"
    trial = built.compile_trial
    return {
        "params": built.n_params,
        "compiled": compiled,
        # compiled before the loop when `auto` timed it in this run
        "compile_before_s": trials_compile_s(trial),
        "compile_auto": trial.as_dict() | {"chosen": cfg.train.compile} if trial else None,
        "loss_kernel_auto": kernel_record(r.loss_kernel_timing, cfg.train.loss_kernel),
        "gelu_kernel_auto": kernel_record(r.gelu_kernel_timing, cfg.train.gelu_kernel),
        "attention_auto": r.attention_timing,
        "floor_s": None if interrupted else run_floor(built, step_s),
        "peak_mem_bytes": peak_bytes(device),
        "peak_mem_kind": peak_kind(device),
        "memory": memory or None,
        "offload": built.homes(),
        "precision": built.policy.name,
        "precision_auto": r.precision_auto,
        "device": str(device),
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        **torch_environment(),
        "config": to_dict(cfg),
        "data": built.data.report() if built.data is not None else None,
        **({"dist": distributed_summary(built, memory)} if built.dist.enabled else {}),
    }


def distributed_summary(built: Built, memory: dict[str, Any] | None = None) -> dict[str, Any]:
    """Per-process measurements (a collective): peak memory and the bytes of this process's
    parameters, gradients' shards and optimizer states."""
    ctx = built.dist
    params = list({id(p): p for p in built.model.parameters()}.values())
    mine = {
        "rank": ctx.rank,
        "peak_mem_bytes": peak_bytes(built.device),
        "param_bytes": sum(local_tensor(p).numel() * p.element_size() for p in params),
        "optimizer_bytes": optimizer_state_bytes(built.optimizer),
        "param_device": str(local_tensor(params[0]).device),
        "memory": memory or None,  # this process's measured step (train.measure_memory)
    }
    return {
        "strategy": ctx.strategy,
        "layout": ctx.layout.sizes(),
        "world_size": ctx.world_size,
        "backend": ctx.backend,
        "reshard_after_forward": built.cfg.dist.reshard_after_forward,
        "cpu_offload": built.cfg.dist.cpu_offload,
        **compression_summary(built, params),
        **pipeline_summary(built),
        "per_rank": ctx.gather(mine),
    }


def pipeline_summary(built: Built) -> dict[str, Any]:
    """A pipeline's stages (their blocks), micro-batches and idle share."""
    pipe = built.step.pipeline
    if pipe is None:
        return {}
    d = built.cfg.dist
    return {
        "pipeline": {
            "schedule": d.pp_schedule,
            "stages": [[r.start, r.stop] for r in pipe.ranges],
            "micro_batches": pipe.micro_batches,
            "bubble": bubble(built.dist.layout, d.pp_schedule, pipe.micro_batches),
        }
    }


def compression_summary(built: Built, params: list[torch.Tensor]) -> dict[str, Any]:
    """DDP's gradient bytes each process puts into the all-reduce per step, compressed and not
    (the ring sends 2 (N - 1) / N times that)."""
    spec = built.cfg.dist.grad_compression
    if built.dist.strategy != "ddp":
        return {}
    return {
        "grad_compression": spec,
        "allreduce_bytes_per_step": compression.sent_bytes(params, spec),
        "uncompressed_bytes_per_step": compression.sent_bytes(params, "none"),
    }


def recheck_peak(built: Built, summary: dict[str, Any]) -> None:
    """A CPU run faster than its cached matmul peak proves the figure stale (measured while
    another process ran, or on other hardware under the same key): measure it again for the
    next runs, and say so."""
    if built.device.type != "cpu" or not summary["mfu"] or summary["mfu"] <= 1.0:
        return
    if not built.dist.is_main:  # one measurement per job: ranks measuring at once slow each other
        return
    from onegpu.perf.devices import cpu_peak
    from onegpu.techniques.precision import bf16_native

    dtype = built.policy.compute_dtype
    if dtype != torch.float32 and not (dtype == torch.bfloat16 and bf16_native(built.device)):
        return  # an emulated dtype's peak bounds nothing: autocast runs much of it in fp32

    fresh = cpu_peak(dtype, refresh=True).flops
    warnings.warn(
        f"MFU {summary['mfu']:.0%} exceeds the cached CPU matmul peak "
        f"({summary['peak_flops'] / 1e9:,.0f} GFLOP/s): measured again, "
        f"{fresh / 1e9:,.0f} GFLOP/s (kept for the next runs unless timed on busy CPUs; "
        "onegpu info shows what is kept)",
        stacklevel=1,
    )
