"""The training loop: build, then steps; metrics are read from the device once per log step.

Under torchrun every process runs this loop on its share of each global batch; rank 0 alone
writes the run folder (metrics, summary, final weights), every process writes its checkpoint
shards, and the processes agree on every step whether a signal asked them to stop.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import signal
import warnings
from pathlib import Path
from typing import Any

import torch
from torch.profiler import record_function
from tqdm.auto import tqdm

from onegpu.build import Built, build, make_model, resolve_device
from onegpu.config import Config, to_dict
from onegpu.data.loader import DevicePrefetcher, count_targets, make_eval_batches, make_train_loader
from onegpu.distributed import DistContext, dcp, init_distributed
from onegpu.distributed.context import shutdown
from onegpu.distributed.parallelize import local_tensor
from onegpu.memory.measure import peak_bytes, peak_kind, reset_peak
from onegpu.perf import allocator
from onegpu.perf.devices import peak_flops
from onegpu.train import checkpoint as ckpt
from onegpu.train import resume
from onegpu.train.measure import measure_step
from onegpu.train.meter import Meter
from onegpu.train.run_folder import RunFolder, environment, resolve_out_dir
from onegpu.train.sharded_save import ShardedSaver
from onegpu.train.signals import GracefulStop


def train(cfg: Config) -> dict[str, Any]:
    """Run training as configured; returns the summary also written to summary.json."""
    allocator.apply()  # library users get the tuned glibc malloc too (perf/allocator.py)
    ctx = init_distributed(cfg.dist, resolve_device(cfg.train.device).type)
    try:
        return _train(cfg, ctx)
    finally:
        shutdown(ctx)


def _train(cfg: Config, ctx: DistContext) -> dict[str, Any]:
    # the folder is checked before any work (by rank 0; every process gets its answer)
    out_dir = ctx.on_main(lambda: resolve_out_dir(cfg.out, resuming=bool(cfg.train.resume)))
    previous = resume.find(cfg, out_dir, ctx)  # a bad checkpoint fails before the build
    built = build(cfg, dist_ctx=ctx)
    cfg, tcfg = built.cfg, built.cfg.train  # the resolved config: what runs
    start = resume.restore(built, previous) if previous else 0
    run = RunFolder(out_dir, cfg, resume_step=start if previous else None, main=ctx.is_main)
    run.write_model_files(cfg, built.data.tokenizer)
    ctx.barrier()  # the folder is ready (an overwritten run's checkpoints gone) for every rank
    batches, eval_batches = training_batches(built, start), validation_batches(built)
    peak = peak_flops(built.device, built.policy.compute_dtype, built.policy.name)
    if peak and ctx.world_size > 1:  # MFU over all devices
        peak = dataclasses.replace(
            peak, flops=peak.flops * ctx.world_size, source=f"{peak.source} x {ctx.world_size}"
        )
    meter = Meter(built.step, built.flops_per_token, peak)
    meter.resume(start, previous.state["meter"] if previous else {})
    memory: dict[str, Any] = {}
    val_loss = None
    if ctx.is_main:
        print(describe(built, out_dir, start))
    resume.start_rng(built, previous)  # the dropout stream: from the seed, or as it was saved
    built.model.train()
    reset_peak(built.device)
    bar = tqdm(
        total=tcfg.max_steps,
        initial=start,
        disable=not cfg.out.progress or not ctx.is_main,
        dynamic_ncols=True,
        unit="step",
    )
    sharded = ShardedSaver(run, built) if ctx.enabled else None
    with GracefulStop() as stop, out_of_memory_report(run, built, meter):
        for step in range(start, tcfg.max_steps):
            with record_function("data"):
                x, y, n_tokens = next(batches)
            if step == min(1, tcfg.max_steps - 1) and tcfg.measure_memory and not ctx.enabled:
                # the second step: optimizer states exist, as in every later step
                out, memory = measure_step(built, x, y, n_tokens, step)
            else:
                out = built.step(x, y, n_tokens, step)
            meter.add(out, x.numel() * ctx.world_size)  # every process runs an equal share
            bar.update(1)
            if ctx.enabled:  # a signal to any process stops them all after the same step
                stop.agree(ctx.gather(stop.signum or 0))
            last = step + 1 == tcfg.max_steps
            if (step + 1) % tcfg.log_every == 0 or last or stop.requested:
                row = meter.flush()
                run.log(row)
                bar.set_postfix(progress_fields(row))
                if meter.skipped_in_a_row >= tcfg.max_consecutive_skips:
                    stop.diverged = True  # the weights are those of the last good step
            if tcfg.eval_every and ((step + 1) % tcfg.eval_every == 0 or last):
                val_loss = built.step.evaluate(eval_batches)
                run.log({"step": step + 1, "val_loss": val_loss, "val_ppl": _ppl(val_loss)})
                if ctx.is_main:
                    bar.write(
                        f"step {step + 1}: val_loss {val_loss:.4f} (ppl {_ppl(val_loss):.2f})"
                    )
                meter.restart_clock()  # evaluation time is not training time
            ending = last or stop.requested or stop.diverged
            if checkpoint_due(cfg, step + 1, ending):
                save_checkpoint(run, built, meter, sharded, wait=ending)
            if stop.requested or stop.diverged:
                break
    if sharded is not None:
        sharded.finish()  # a background save still in flight (e.g. skipped non-finite last)
    bar.close()
    summary = summarize(built, meter, memory, stop, val_loss)
    recheck_peak(built, summary)
    if ctx.enabled:
        summary["dist"] = distributed_summary(built)
    if cfg.out.save_checkpoint and meter.steps == tcfg.max_steps and not stop.diverged:
        save_final_weights(run, built)
    run.write_summary(summary)
    run.close()
    return summary


class TrainingOutOfMemory(RuntimeError):
    """The device ran out of memory; the CLI answers with the planner's cheapest fixes."""

    def __init__(self, step: int, device: torch.device, snapshot: Path | None):
        super().__init__(f"out of memory at step {step + 1} on {device}")
        self.step, self.device, self.snapshot = step, device, snapshot


@contextlib.contextmanager
def out_of_memory_report(run: RunFolder, built: Built, meter: Meter):
    """Turn an allocator failure into TrainingOutOfMemory, with a CUDA memory snapshot (for
    https://pytorch.org/memory_viz) in the run folder; checkpoints already written stay."""
    try:
        yield
    except torch.OutOfMemoryError:
        snapshot = None
        if built.device.type == "cuda":
            snapshot = run.path / "oom_memory_snapshot.pickle"
            torch.cuda.memory._dump_snapshot(str(snapshot))
        run.close()
        raise TrainingOutOfMemory(meter.steps, built.device, snapshot) from None


def distributed_summary(built: Built) -> dict[str, Any]:
    """Per-process measurements (a collective): peak memory and the bytes of this process's
    parameters, gradients' shards and optimizer states."""
    from onegpu.optim.state_bytes import optimizer_state_bytes

    ctx = built.dist
    params = list({id(p): p for p in built.model.parameters()}.values())
    mine = {
        "rank": ctx.rank,
        "peak_mem_bytes": peak_bytes(built.device),
        "param_bytes": sum(local_tensor(p).numel() * p.element_size() for p in params),
        "optimizer_bytes": optimizer_state_bytes(built.optimizer),
        "param_device": str(local_tensor(params[0]).device),
    }
    return {
        "strategy": ctx.strategy,
        "world_size": ctx.world_size,
        "backend": ctx.backend,
        "reshard_after_forward": built.cfg.dist.reshard_after_forward,
        "cpu_offload": built.cfg.dist.cpu_offload,
        "per_rank": ctx.gather(mine),
    }


def _ppl(loss: float) -> float:
    return math.exp(min(loss, 50))


def _num_workers(cfg: Config, device: torch.device) -> int:
    if cfg.data.num_workers >= 0:
        return cfg.data.num_workers
    return 2 if device.type == "cuda" else 0  # on CPU workers compete with compute for cores


def training_batches(built: Built, start_step: int = 0) -> DevicePrefetcher:
    """(inputs, targets, target count) batches from step `start_step` on, copied to the device
    one step ahead."""
    cfg = built.cfg
    loader = make_train_loader(
        built.data.train,
        seq_len=cfg.train_seq_len,
        batch_size=cfg.train.batch_size,
        seed=cfg.train.seed,
        start=start_step * cfg.train.batch_size,
        num_workers=_num_workers(cfg, built.device),
        pin_memory=built.device.type == "cuda",
        classes=built.classes,
    )
    ctx = built.dist
    if not ctx.enabled:
        return DevicePrefetcher(((x, y, count_targets(y)) for x, y in loader), built.device)

    def shares():  # this process's rows of each global batch; the target count is the batch's
        for x, y in loader:
            rows = slice(
                ctx.rank * len(x) // ctx.world_size, (ctx.rank + 1) * len(x) // ctx.world_size
            )
            yield x[rows], y[rows], count_targets(y)

    return DevicePrefetcher(shares(), built.device)


def validation_batches(built: Built) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The fixed validation batches of every evaluation (none when evaluation is off)."""
    t = built.cfg.train
    if not t.eval_every:
        return []
    return make_eval_batches(
        built.data.val,
        seq_len=built.cfg.train_seq_len,
        batch_size=t.micro_batch_size,
        n_batches=t.eval_batches,
        classes=built.classes,
    )


def describe(built: Built, out_dir: Path, start: int) -> str:
    cfg, ctx = built.cfg, built.dist
    resumed = f" | resumed at step {start}" if start else ""
    where = f"{built.device}"
    micro = f"{built.step.n_micro} micro-batch(es)"
    if ctx.enabled:
        where = (
            f"{ctx.strategy} over {ctx.world_size} processes ({ctx.backend}, {built.device.type})"
        )
        micro = f"{ctx.world_size} processes x {micro} of {cfg.train.micro_batch_size}"
    return (
        f"onegpu: {built.n_params:,} parameters | {where} | {built.policy.name} | "
        f"batch {cfg.train.batch_size}x{cfg.train_seq_len} tokens in {micro} | "
        f"{describe_auto(built)}data {built.data.description} | run folder {out_dir}{resumed}"
    )


def describe_auto(built: Built) -> str:
    """What the `auto` loss chunk and compile chose ('' where neither was auto)."""
    cfg, parts = built.cfg, []
    if built.asked and built.asked.memory.loss_chunk == "auto":
        parts.append(f"loss chunk {cfg.memory.loss_chunk or 'off'}")
    if trial := built.compile_trial:
        how = "cached" if trial.cached else f"compiled in {trial.compile_s:.0f} s"
        parts.append(
            f"compile {cfg.train.compile} (eager {trial.eager_s * 1e3:,.0f} ms vs compiled "
            f"{trial.compiled_s * 1e3:,.0f} ms a micro-batch; {how})"
        )
    return "auto: " + ", ".join(parts) + " | " if parts else ""


def progress_fields(row: dict[str, Any]) -> dict[str, str]:
    return {
        "loss": f"{row['loss']:.3f}",
        "tok_s": f"{row['tokens_per_s']:,.0f}",
        "mfu": f"{row['mfu']:.1%}" if row["mfu"] is not None else "n/a",
        "mem": f"{row['peak_mem_bytes'] / 2**20:,.0f}MiB",
    }


def summarize(
    built: Built, meter: Meter, memory: dict, stop: GracefulStop, val_loss: float | None
) -> dict[str, Any]:
    """summary.json: medians of the steady intervals, memory, and what ran where."""
    cfg, device, peak = built.cfg, built.device, meter.peak
    steady = meter.steady()
    tokens_per_step = cfg.train.batch_size * cfg.train_seq_len
    step_s = tokens_per_step / steady["tokens_per_s"] if steady["tokens_per_s"] else None
    compiled = cfg.train.compile != "none"
    trial = built.compile_trial
    # compiled before the loop when `auto` timed it in this run
    compile_before = trial.compile_s if trial and not trial.cached and compiled else 0.0
    return {
        "params": built.n_params,
        "tokens": meter.tokens,
        "tokens_per_s": steady["tokens_per_s"],
        "step_time_s": step_s,
        "first_step_s": meter.first_step_s,
        # the first step's excess over a steady step: compilation (and warm-up)
        "compile_time_s": (
            max(0.0, meter.first_step_s - step_s) + compile_before if step_s and compiled else None
        ),
        "compile_auto": trial.as_dict() | {"chosen": cfg.train.compile} if trial else None,
        "mfu": steady["mfu"],
        "peak_mem_bytes": peak_bytes(device),
        "peak_mem_kind": peak_kind(device),
        "memory": memory or None,
        "loss": meter.loss,
        "val_loss": val_loss,
        "steps": meter.steps,
        "interrupted": stop.requested,
        "signal": signal.Signals(stop.signum).name if stop.requested else None,
        "diverged": stop.diverged,
        "skipped_steps": meter.skipped,
        "train_time_s": meter.elapsed(),
        "flops_per_token": built.flops_per_token,
        "peak_flops": peak.flops if peak else None,
        "peak_flops_source": peak.source if peak else None,
        "precision": built.policy.name,
        "device": str(device),
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        **environment(),
        "config": to_dict(cfg),
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
        f"{fresh / 1e9:,.0f} GFLOP/s, for the next runs (onegpu info shows it)",
        stacklevel=1,
    )


def checkpoint_due(cfg: Config, step: int, final: bool) -> bool:
    """At the end, on interruption, and every checkpoint.every steps."""
    if not cfg.out.save_checkpoint:
        return False
    every = cfg.checkpoint.every
    return final or (every > 0 and step % every == 0)


def weights_finite(built: Built) -> bool:
    """Checked before anything is saved (one host read per save, not per step); over every
    process's shards under torchrun."""
    params = [local_tensor(p.detach()) for p in built.model.parameters()]
    finite = bool(torch.stack([torch.isfinite(p).all() for p in params]).all())
    return not built.dist.any_true(not finite)


def save_checkpoint(
    run: RunFolder,
    built: Built,
    meter: Meter,
    sharded: ShardedSaver | None = None,
    wait: bool = True,
) -> Path | None:
    """Write the checkpoint of the state after `meter.steps` steps, crash-safely, then prune
    (under torchrun through `sharded`, which may finish in the background unless `wait`).
    Weights that are not finite are never saved: the newer checkpoints stay the last good."""
    if not weights_finite(built):
        if built.dist.is_main:
            warnings.warn(
                f"step {meter.steps}: non-finite weights, checkpoint not written", stacklevel=1
            )
        return None
    if sharded is not None:
        return sharded.save(meter, wait=wait)
    state = resume.state_of(built, step=meter.steps, meter=meter.state_dict())
    path = run.checkpoints / ckpt.checkpoint_name(meter.steps)
    ckpt.write_atomic(path, state)
    c = built.cfg.checkpoint
    ckpt.prune(run.checkpoints, keep_last=c.keep_last, keep_every=c.keep_every)
    return path


def save_final_weights(run: RunFolder, built: Built) -> None:
    """The trained weights alone, as safetensors (what other tools load), written atomically
    by rank 0; never non-finite weights. FSDP's shards are gathered into a whole model first."""
    from safetensors.torch import save_model

    if not weights_finite(built):
        if built.dist.is_main:
            warnings.warn("non-finite weights: model.safetensors not written", stacklevel=1)
        return
    model = built.model
    if built.dist.strategy == "fsdp":
        full = dcp.full_model_state(model)  # collective; the tensors land on rank 0's host
        if not built.dist.is_main:
            return
        with torch.device("meta"):
            model = make_model(built.cfg)
        model.to_empty(device="cpu")
        model.load_state_dict(full)
        if hasattr(model, "tie_weights"):
            model.tie_weights()
    if not built.dist.is_main:
        return
    path = run.path / "model.safetensors"
    tmp = path.with_name(f"{ckpt.TMP_PREFIX}{path.name}.{os.getpid()}")
    save_model(model, str(tmp), metadata={"format": "pt"})
    os.replace(tmp, path)
