"""Every run, whichever backend trains it: the folder and its lock, the checkpoint to resume
and its checks, the loop (logging, evaluation, checkpoint cadence, the non-finite guard's
count, stopping on a signal), the summary and the final weights. The framework's part is a
`Backend` (runs/backend.py); nothing here imports one.

Under torchrun every process runs this on its share of each global batch, the main process
alone speaks and writes the run folder, and the processes agree on every step whether a signal
asked them to stop (each a no-op on one process).
"""

from __future__ import annotations

import math
import warnings
from pathlib import Path
from typing import Any

from tqdm.auto import tqdm

from onegpu.config import Config
from onegpu.runs import checkpoints
from onegpu.runs.backend import Backend, Processes
from onegpu.runs.checkpoints import Checkpoint
from onegpu.runs.folder import RunFolder, resolve_out_dir, writes_of
from onegpu.runs.lock import release_run_folder
from onegpu.runs.meter import Meter
from onegpu.runs.outcome import run_outcome
from onegpu.runs.saver import Saver
from onegpu.runs.signals import GracefulStop


def run(cfg: Config, backend: Backend) -> dict[str, Any]:
    """Train as configured on `backend`; returns the summary also written to summary.json."""
    with backend.processes(cfg) as group:
        # the folder is checked and locked before any work (by the main process; every
        # process gets its answer); refused before the run folder is written, it is left as
        # it was
        out_dir = group.on_main(lambda: resolve_out_dir(cfg.out, resuming=bool(cfg.train.resume)))
        try:
            previous = _find(cfg, out_dir, backend, group)  # a bad checkpoint fails first
            if previous is not None:
                cfg = checkpoints.keep_decisions(previous.state.get("config"), cfg)
            backend.check_memory(cfg)
            built_cfg = backend.build(cfg)
            if previous is not None:
                _restore(built_cfg, backend, previous)
            start = previous.step if previous else 0
            folder = RunFolder(
                out_dir, built_cfg, resume_step=start if previous else None, main=group.is_main
            )
        except BaseException:
            release_run_folder(out_dir, unused=True)
            raise
        try:
            with writes_of(out_dir):  # a failed write of the folder: a resume continues the run
                return _run(built_cfg, backend, group, folder, previous)
        finally:
            release_run_folder(out_dir)


def _find(cfg: Config, out_dir: Path, backend: Backend, group: Processes) -> Checkpoint | None:
    """The checkpoint train.resume names. A resume never continues another backend's run; a
    killed save's leftovers are removed first."""
    if cfg.train.resume:
        group.on_main(lambda: _prepare_resume(cfg, out_dir, backend.name))

    def warn(message: str) -> None:
        if group.is_main:
            warnings.warn(message, stacklevel=3)

    return checkpoints.find(
        cfg, out_dir, backend=backend.name, read=backend.read_checkpoint, warn=warn
    )


def _prepare_resume(cfg: Config, out_dir: Path, backend: str) -> None:
    checkpoints.refuse_other_backend(out_dir, backend)  # before anything there is touched
    if cfg.train.resume == "auto" and (out_dir / "checkpoints").is_dir():
        checkpoints.remove_partial(out_dir / "checkpoints")


def _restore(cfg: Config, backend: Backend, previous: Checkpoint) -> None:
    """The same run on the same data, then the backend's state as it was saved."""
    checkpoints.check_same_run(previous.state.get("config"), cfg)
    checkpoints.check_same_data(previous.state.get("data"), backend.data_fingerprint(), cfg)
    backend.load_state(previous)


def _run(
    cfg: Config,
    backend: Backend,
    group: Processes,
    folder: RunFolder,
    previous: Checkpoint | None,
) -> dict[str, Any]:
    """The run, once its folder is written and its model built (and restored)."""
    start = previous.step if previous else 0
    if previous is not None and start >= cfg.train.max_steps:  # resumed a finished run
        done = folder.read_summary()
        if done is not None:
            group.say(
                f"onegpu: {folder.path} finished at step {start} already; raise "
                "--train.max_steps to train on"
            )
            folder.close()
            return done
    folder.write_model_files(cfg.model, backend.tokenizer, backend.chat_template)
    group.barrier()  # the folder is ready (an overwritten run's checkpoints gone) for every rank
    # the batches first: a loader may draw its seed from the global generator, before the
    # random streams are set (or restored) by seed()
    backend.start(start)
    meter = backend.meter()
    meter.resume(start, previous.state["meter"] if previous else {})
    group.say(backend.describe(folder.path, start))
    backend.seed(previous)
    saver = Saver(folder, backend, cfg, group)
    # the saves after the loop are covered too: a signal there is the graceful one (noted, the
    # save finishes), a second one stops at once (runs/signals.py)
    with GracefulStop() as stop:
        with backend.guard(folder, meter):
            val_loss = _loop(cfg, backend, group, folder, meter, saver, stop, start)
        saver.finish()  # a background save still in flight
        summary = _summary(cfg, backend, meter, stop, val_loss)
        summary["last_good_checkpoint"] = str(saver.last_good) if saver.last_good else None
        backend.finished(summary)
        finished = meter.steps == cfg.train.max_steps and not stop.diverged
        if cfg.out.save_checkpoint and finished:
            saver.final_weights()
        folder.write_summary(summary)
        folder.close()
    return summary


def _loop(
    cfg: Config,
    backend: Backend,
    group: Processes,
    folder: RunFolder,
    meter: Meter,
    saver: Saver,
    stop: GracefulStop,
    start: int,
) -> float | None:
    """Steps `start`..max_steps (or until a signal or divergence); returns the last
    validation loss (None if none)."""
    t = cfg.train
    val_loss = None
    bar = tqdm(
        total=t.max_steps,
        initial=start,
        dynamic_ncols=True,
        unit="step",
        disable=not cfg.out.progress or not group.is_main,
    )
    for step in range(start, t.max_steps):
        stepped = backend.step(step)
        if stepped.measured_s is not None:
            meter.leave_out(stepped.measured_s, stepped.tokens, stepped.trained)
        meter.add(stepped.out, stepped.tokens, stepped.trained)
        bar.update(1)
        stop.agree(group.gather(stop.signum or 0))  # a signal to any process stops them all
        last = step + 1 == t.max_steps
        if (step + 1) % t.log_every == 0 or last or stop.requested:
            row = meter.flush()
            folder.log(row)
            bar.set_postfix(progress_fields(row))
            if meter.skipped_in_a_row >= t.max_consecutive_skips:
                stop.diverged = True  # the weights are those of the last good step
        if t.eval_every and ((step + 1) % t.eval_every == 0 or last):
            val_loss = backend.evaluate()
            ppl = math.exp(min(val_loss, 50))
            folder.log({"step": step + 1, "val_loss": val_loss, "val_ppl": ppl})
            group.say(f"step {step + 1}: val_loss {val_loss:.4f} (ppl {ppl:.2f})", bar.write)
            meter.restart_clock()  # evaluation time is not training time
        ending = last or stop.requested or stop.diverged
        if checkpoint_due(cfg, step + 1, ending):
            saver.save(meter, wait=ending)
        if stop.requested or stop.diverged:
            break
    bar.close()
    return val_loss


def checkpoint_due(cfg: Config, step: int, final: bool) -> bool:
    """At the end, on interruption, and every checkpoint.every steps."""
    if not cfg.out.save_checkpoint:
        return False
    every = cfg.checkpoint.every
    return final or (every > 0 and step % every == 0)


def progress_fields(row: dict[str, Any]) -> dict[str, str]:
    """The progress bar's fields of a log row."""
    return {
        "loss": f"{row['loss']:.3f}",
        "tok_s": f"{row['tokens_per_s']:,.0f}" if row["tokens_per_s"] is not None else "n/a",
        "mfu": f"{row['mfu']:.1%}" if row["mfu"] is not None else "n/a",
        "mem": f"{row['peak_mem_bytes'] / 2**20:,.0f}MiB",
    }


def _compile_time(
    meter: Meter, step_s: float | None, compiled: bool, before_s: float
) -> float | None:
    """The first step's excess over a steady step (compilation, and warm-up) when the run
    compiled, plus what was compiled before the loop (`auto`'s trials, whichever it chose)."""
    if not step_s or not (compiled or before_s):
        return None
    return (max(0.0, meter.first_step_s - step_s) if compiled else 0.0) + before_s


def _trained(meter: Meter, steady: dict[str, Any]) -> dict[str, Any]:
    """Trained tokens (those whose targets carry loss) beside all tokens, where data masks."""
    if not meter.masked:
        return {}
    return {"trained_tokens": meter.trained, "trained_tokens_per_s": steady["trained_tokens_per_s"]}


def _summary(
    cfg: Config, backend: Backend, meter: Meter, stop: GracefulStop, val_loss: float | None
) -> dict[str, Any]:
    """summary.json: medians of the steady intervals, how the run ended, and the backend's
    own fields (memory, device, versions, compilation)."""
    steady = meter.steady()
    tokens_per_step = cfg.train.batch_size * cfg.train_seq_len
    step_s = tokens_per_step / steady["tokens_per_s"] if steady["tokens_per_s"] else None
    outcome = run_outcome(meter, stop, val_loss)
    own = backend.summary(meter, step_s, interrupted=outcome["interrupted"])
    compiled, compile_before = own.pop("compiled"), own.pop("compile_before_s")
    floor_s = own.pop("floor_s", None)  # the step's matmul floor, where the backend measures it
    return {
        "backend": backend.name,
        "params": own.pop("params"),
        "tokens": meter.tokens,
        "tokens_per_s": steady["tokens_per_s"],
        **_trained(meter, steady),
        "step_time_s": step_s,
        "first_step_s": meter.first_step_s,
        "compile_time_s": _compile_time(meter, step_s, compiled, compile_before),
        "mfu": steady["mfu"],
        "floor_s": floor_s,
        "step_over_floor": step_s / floor_s if step_s and floor_s else None,
        "peak_flops": meter.peak.flops if meter.peak else None,
        "peak_flops_source": meter.peak.source if meter.peak else None,
        **outcome,
        "flops_per_token": meter.flops_per_token,
        **own,
    }
