"""The training loop: build, then steps; metrics are read from the device once per log step.

The loop knows no strategy, checkpoint format or model kind: under torchrun every process runs
it on its share of each global batch (train/batches.py), the saver chosen once writes single
files or shards (train/saver.py), rank 0 alone speaks and writes the run folder, and the
processes agree on every step whether a signal asked them to stop (each a no-op on one
process, distributed/context.py).
"""

from __future__ import annotations

import math
import time
from pathlib import Path
from typing import Any

from torch.profiler import record_function
from tqdm.auto import tqdm

from onegpu.batches import DevicePrefetcher
from onegpu.build import Built, build, resolve_device
from onegpu.config import Config, with_offload_params
from onegpu.distributed import DistContext, init_distributed
from onegpu.distributed.context import shutdown
from onegpu.memory.measure import reset_peak
from onegpu.perf import allocator
from onegpu.runs.folder import RunFolder, resolve_out_dir, writes_of
from onegpu.runs.lock import release_run_folder
from onegpu.runs.meter import Meter
from onegpu.runs.signals import GracefulStop
from onegpu.train import resume
from onegpu.train.batches import training_batches, validation_batches
from onegpu.train.measure import measure_step, measured_step
from onegpu.train.oom import TrainingOutOfMemory, out_of_memory_report
from onegpu.train.report import describe, progress_fields, recheck_peak, run_peak, summarize
from onegpu.train.saver import Saver, make_saver
from onegpu.train.totals import meter_for

__all__ = ["TrainingOutOfMemory", "train"]


def train(cfg: Config) -> dict[str, Any]:
    """Run training as configured; returns the summary also written to summary.json."""
    allocator.apply()  # library users get the tuned glibc malloc too (perf/allocator.py)
    cfg = with_offload_params(cfg)  # weights on the host: FSDP2's CPU offload, one process
    device_type = resolve_device(cfg.train.device).type
    ctx = init_distributed(cfg.dist, device_type, alone=cfg.memory.offload_params)
    try:
        return _train(cfg, ctx)
    finally:
        shutdown(ctx)


def _train(cfg: Config, ctx: DistContext) -> dict[str, Any]:
    # the folder is checked and locked before any work (by rank 0; every process gets its
    # answer); refused before the run folder is written, it is left as it was
    out_dir = ctx.on_main(lambda: resolve_out_dir(cfg.out, resuming=bool(cfg.train.resume)))
    try:
        previous = resume.find(cfg, out_dir, ctx)  # a bad checkpoint fails before the build
        built = build(cfg, dist_ctx=ctx)
        start = resume.restore(built, previous) if previous else 0
        run = RunFolder(out_dir, built.cfg, resume_step=start if previous else None,
                        main=ctx.is_main)  # fmt: skip
    except BaseException:
        release_run_folder(out_dir, unused=True)
        raise
    try:
        with writes_of(out_dir):  # a failed write of the folder: a resume continues the run
            return _run(cfg, ctx, built, run, previous, start, out_dir)
    finally:
        release_run_folder(out_dir)


def _run(
    cfg: Config,
    ctx: DistContext,
    built: Built,
    run: RunFolder,
    previous: Any,
    start: int,
    out_dir: Path,
) -> dict[str, Any]:
    """The run, once its folder is written and its model built (and restored)."""
    if previous is not None and start >= cfg.train.max_steps:  # resumed a finished run
        done = run.read_summary()
        if done is not None:
            ctx.say(f"onegpu: {out_dir} finished at step {start} already; raise "
                    "--train.max_steps to train on")  # fmt: skip
            run.close()
            return done
    run.write_model_files(built.cfg, built.data.tokenizer)
    ctx.barrier()  # the folder is ready (an overwritten run's checkpoints gone) for every rank
    # the batches first: their loader draws its seed from the global generator, before the
    # dropout stream is set (or restored) by start_rng
    batches = training_batches(built, start), validation_batches(built)
    meter = meter_for(built, run_peak(built))
    meter.resume(start, previous.state["meter"] if previous else {})
    ctx.say(describe(built, out_dir, start))
    resume.start_rng(built, previous)  # the dropout stream: from the seed, or as it was saved
    saver = make_saver(run, built)
    # the saves after the loop are covered too: a signal there is the graceful one (noted, the
    # save finishes), a second one stops at once (runs/signals.py)
    with GracefulStop() as stop:
        with out_of_memory_report(run, built.device, meter):
            memory, val_loss = _loop(built, run, meter, saver, stop, batches, start)
        saver.finish()  # a background save still in flight (e.g. skipped non-finite last)
        summary = summarize(built, meter, memory, stop, val_loss)
        summary["last_good_checkpoint"] = str(saver.last_good) if saver.last_good else None
        recheck_peak(built, summary)
        finished = meter.steps == built.cfg.train.max_steps and not stop.diverged
        if built.cfg.out.save_checkpoint and finished:
            saver.final_weights()
        run.write_summary(summary)
        run.close()
    return summary


def _loop(
    built: Built,
    run: RunFolder,
    meter: Meter,
    saver: Saver,
    stop: GracefulStop,
    batches: tuple[DevicePrefetcher, list],
    start: int,
) -> tuple[dict[str, Any], float | None]:
    """Steps `start`..max_steps (or until a signal or divergence); returns the measured memory
    breakdown ({} if not measured) and the last validation loss (None if none)."""
    cfg, tcfg, ctx = built.cfg, built.cfg.train, built.dist
    batches, eval_batches = batches
    measure_at = measured_step(built)
    memory: dict[str, Any] = {}
    val_loss = None
    built.model.train()
    reset_peak(built.device)
    bar = tqdm(total=tcfg.max_steps, initial=start, dynamic_ncols=True, unit="step",
               disable=not cfg.out.progress or not ctx.is_main)  # fmt: skip
    for step in range(start, tcfg.max_steps):
        with record_function("data"):
            x, y, n_tokens = next(batches)
        if step == measure_at:  # optimizer states exist by then, as in every later step
            t0 = time.perf_counter()
            out, memory = measure_step(built, x, y, n_tokens, step)
            meter.leave_out(time.perf_counter() - t0, x.numel() * ctx.world_size)
        else:
            out = built.step(x, y, n_tokens, step)
        meter.add(out, x.numel() * ctx.world_size)  # every process runs an equal share
        bar.update(1)
        stop.agree(ctx.gather(stop.signum or 0))  # a signal to any process stops them all
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
            ctx.say(f"step {step + 1}: val_loss {val_loss:.4f} (ppl {_ppl(val_loss):.2f})", bar.write)  # fmt: skip
            meter.restart_clock()  # evaluation time is not training time
        ending = last or stop.requested or stop.diverged
        if checkpoint_due(cfg, step + 1, ending):
            saver.save(meter, wait=ending)
        if stop.requested or stop.diverged:
            break
    bar.close()
    return memory, val_loss


def _ppl(loss: float) -> float:
    return math.exp(min(loss, 50))


def checkpoint_due(cfg: Config, step: int, final: bool) -> bool:
    """At the end, on interruption, and every checkpoint.every steps."""
    if not cfg.out.save_checkpoint:
        return False
    every = cfg.checkpoint.every
    return final or (every > 0 and step % every == 0)
