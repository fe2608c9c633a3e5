"""`onegpu train --train.backend jax`: the torch loop's run on JAX. The same run folder
(config.toml, metrics.jsonl rows with the same fields, summary.json, model.safetensors in the
torch GPT's layout), the same batches in the same order, the same meter, progress bar, signal
handling (a first Ctrl-C saves and stops, a second stops at once) and folder lock."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from tqdm.auto import tqdm

from onegpu.config import Config, ConfigError, to_dict
from onegpu.config.schedule import lr_at
from onegpu.data.windows import eval_windows, train_windows
from onegpu.jaxbackend import require_jax, state
from onegpu.perf.allocator import active_allocator
from onegpu.perf.peaks import cached_cpu_peak
from onegpu.runs.folder import RunFolder, environment, resolve_out_dir, writes_of
from onegpu.runs.lock import release_run_folder
from onegpu.runs.meter import Meter
from onegpu.runs.outcome import run_outcome
from onegpu.runs.signals import GracefulStop


def train(cfg: Config) -> dict[str, Any]:
    """Run training as configured on JAX; returns the summary also written to summary.json."""
    require_jax()
    from onegpu.jaxbackend.build import build

    out_dir = resolve_out_dir(cfg.out, resuming=bool(cfg.train.resume))
    try:
        built = build(cfg)
        previous = state.find(cfg, out_dir)
        start = _restore(built, previous, out_dir) if previous else 0
        run = RunFolder(out_dir, cfg, resume_step=start if previous else None)
    except BaseException:
        release_run_folder(out_dir, unused=True)
        raise
    try:
        with writes_of(out_dir):  # a failed write of the folder: a resume continues the run
            return _run(built, run, previous, start, out_dir)
    finally:
        release_run_folder(out_dir)


def _restore(built, previous: tuple[Path, dict], out_dir: Path) -> int:
    path, saved = previous
    cfg = built.cfg
    if saved.get("data") != built.data.fingerprint() and not cfg.train.resume_new_data:
        raise ConfigError("data.source", f"{path} was trained on other data ({saved.get('data')}; "
                          f"now {built.data.fingerprint()}); restore the data, or continue on "
                          "this data with --train.resume_new_data true")  # fmt: skip
    built.params = jax.tree_util.tree_map(jnp.asarray, state.restore(built.params, saved["params"]))
    built.opt_state = jax.tree_util.tree_map(
        jnp.asarray, state.restore(built.opt_state, saved["opt_state"])
    )
    return int(saved["step"])


def _describe(built, out_dir: Path, start: int) -> str:
    cfg = built.cfg
    resumed = f" | resumed at step {start}" if start else ""
    scan = " | layers scanned" if cfg.model.scan_layers else ""
    return (f"onegpu: {built.n_params:,} parameters | jax {jax.__version__} on "
            f"{jax.devices()[0].platform} | {built.precision.name}{scan} | batch "
            f"{cfg.train.batch_size}x{cfg.train_seq_len} tokens in {built.n_micro} "
            f"micro-batch(es) | data {built.data.description} | run folder {out_dir}{resumed}")  # fmt: skip


def _run(built, run: RunFolder, previous, start: int, out_dir: Path) -> dict[str, Any]:
    cfg = built.cfg
    if previous is not None and start >= cfg.train.max_steps and (done := run.read_summary()):
        print(f"onegpu: {out_dir} finished at step {start} already; raise --train.max_steps "
              "to train on")  # fmt: skip
        run.close()
        return done
    run.write_model_files(cfg, built.data.tokenizer)
    from onegpu.jaxbackend.totals import HostTotals, peak_rss_bytes

    # JAX dispatches asynchronously: the meter's clock waits for the step's results
    peak = cached_cpu_peak(built.precision.name) if jax.default_backend() == "cpu" else None
    meter = Meter(HostTotals(), built.flops_per_token, peak, peak_memory=peak_rss_bytes,
                  sync=lambda: jax.block_until_ready(built.params))  # fmt: skip
    meter.resume(start, previous[1]["meter"] if previous else {})
    print(_describe(built, out_dir, start), flush=True)
    with GracefulStop() as stop:
        val_loss, last_good = _loop(built, run, meter, stop, start)
        summary = _summary(built, meter, stop, val_loss)
        summary["last_good_checkpoint"] = str(last_good) if last_good else None
        finished = meter.steps == cfg.train.max_steps and not stop.diverged
        if cfg.out.save_checkpoint and finished and _finite(built.params):
            from onegpu.jaxbackend.weights import write_safetensors

            write_safetensors(
                jax.device_get(built.params), cfg.model, run.path / "model.safetensors"
            )
        run.write_summary(summary)
        run.close()
    return summary


def _batches(built, start: int):
    cfg, t = built.cfg, built.cfg.train
    T, n = cfg.train_seq_len, built.n_micro
    for x, y in train_windows(built.data.train, seq_len=T, batch_size=t.batch_size,
                              seed=t.seed, start=start * t.batch_size):  # fmt: skip
        n_tokens = int(np.count_nonzero(y != -100))
        yield x.reshape(n, -1, T), y.reshape(n, -1, T), n_tokens


def _loop(built, run: RunFolder, meter: Meter, stop: GracefulStop, start: int):
    cfg, t = built.cfg, built.cfg.train
    batches = _batches(built, start)
    val = eval_windows(built.data.val, seq_len=cfg.train_seq_len, batch_size=t.micro_batch_size,
                       n_batches=t.eval_batches) if t.eval_every else []  # fmt: skip
    key = jax.random.key(t.seed)
    bar = tqdm(total=t.max_steps, initial=start, dynamic_ncols=True, unit="step",
               disable=not cfg.out.progress)  # fmt: skip
    val_loss, last_good = None, None
    from onegpu.jaxbackend.totals import Out

    first = next(batches, None)
    if first is not None and start < t.max_steps:  # compiled once, ahead: its memory analysis
        # is read from this very executable at the end (no second compile)
        built.step = built.step.lower(built.params, built.opt_state, *first, jnp.float32(0.0),
                                      jax.random.key(0)).compile()  # fmt: skip
    for step in range(start, t.max_steps):
        x, y, n_tokens = first if step == start else next(batches)
        lr = lr_at(step, cfg.optim, t.max_steps)
        built.params, built.opt_state, out = built.step(
            built.params, built.opt_state, x, y, n_tokens, jnp.float32(lr),
            jax.random.fold_in(key, step),
        )  # fmt: skip
        meter.add(Out(out.loss, out.grad_norm, out.skipped, lr), x.size)
        bar.update(1)
        last = step + 1 == t.max_steps
        if (step + 1) % t.log_every == 0 or last or stop.requested:
            row = meter.flush()
            run.log(row)
            bar.set_postfix(loss=f"{row['loss']:.3f}", tok_s=f"{row['tokens_per_s'] or 0:,.0f}")
            if meter.skipped_in_a_row >= t.max_consecutive_skips:
                stop.diverged = True
        if t.eval_every and ((step + 1) % t.eval_every == 0 or last):
            val_loss = _evaluate(built, val)
            run.log(
                {"step": step + 1, "val_loss": val_loss, "val_ppl": math.exp(min(val_loss, 50))}
            )
            bar.write(f"step {step + 1}: val_loss {val_loss:.4f}")
            meter.restart_clock()
        ending = last or stop.requested or stop.diverged
        every = cfg.checkpoint.every
        due = cfg.out.save_checkpoint and (ending or (every > 0 and (step + 1) % every == 0))
        if due and meter.totals.in_a_row() == 0 and _finite(built.params):
            last_good = state.save(run.checkpoints, step + 1, _state(built, meter, step + 1),
                                   cfg.checkpoint.keep_last, cfg.checkpoint.keep_every)  # fmt: skip
        if stop.requested or stop.diverged:
            break
    bar.close()
    return val_loss, last_good


def _state(built, meter: Meter, step: int) -> dict[str, Any]:
    return {"step": step, "params": jax.device_get(built.params),
            "opt_state": jax.device_get(built.opt_state), "meter": meter.state_dict(),
            "data": built.data.fingerprint(), "backend": "jax"}  # fmt: skip


def _finite(params) -> bool:
    return bool(all(jnp.isfinite(p).all() for p in jax.tree_util.tree_leaves(params)))


def _evaluate(built, batches) -> float:
    total, count = 0.0, 0
    for x, y in batches:
        loss, n = built.evaluate(built.params, x, y)
        total, count = total + float(loss), count + int(n)
    return total / max(count, 1)


def _summary(built, meter: Meter, stop: GracefulStop, val_loss: float | None) -> dict[str, Any]:
    from onegpu.jaxbackend.totals import peak_rss_bytes

    cfg = built.cfg
    steady = meter.steady()
    xla = xla_memory(built)
    per_step = cfg.train.batch_size * cfg.train_seq_len
    step_s = per_step / steady["tokens_per_s"] if steady["tokens_per_s"] else None
    return {
        "backend": "jax",
        "params": built.n_params,
        "tokens": meter.tokens,
        "tokens_per_s": steady["tokens_per_s"],
        "step_time_s": step_s,
        "first_step_s": meter.first_step_s,
        "compile_time_s": max(0.0, meter.first_step_s - step_s) if step_s else None,
        "mfu": steady["mfu"],
        "peak_flops": meter.peak.flops if meter.peak else None,
        "peak_flops_source": meter.peak.source if meter.peak else None,
        "peak_mem_bytes": peak_rss_bytes(),
        "peak_mem_kind": "process peak RSS",
        "xla_memory": xla,
        # the step's buffers as XLA planned them: what `onegpu bench` compares across rows
        "memory": {
            "peak": xla_total(xla),
            "kind": "XLA memory analysis (arguments + outputs + temporaries - aliased)",
        }
        if xla
        else None,  # fmt: skip
        **run_outcome(meter, stop, val_loss),
        "flops_per_token": built.flops_per_token,
        "precision": built.precision.name,
        "device": jax.default_backend(),
        "device_name": str(jax.devices()[0].device_kind),
        "config": to_dict(cfg),
        "environment": environment(
            jax=jax.__version__, jax_platform=jax.default_backend(), allocator=active_allocator()
        ),  # fmt: skip
    }


def xla_total(m: dict[str, int]) -> int:
    return m["argument_bytes"] + m["output_bytes"] + m["temp_bytes"] - m["alias_bytes"]


def xla_memory(built) -> dict[str, int] | None:
    """XLA's compiled memory analysis of the step: argument, output and temporary bytes (from
    the executable the run compiled, else compiled here for the shapes of a step)."""
    cfg, t = built.cfg, built.cfg.train
    compiled = built.step
    try:
        if not hasattr(compiled, "memory_analysis"):
            shape = (built.n_micro, t.micro_batch_size, cfg.train_seq_len)
            x = jax.ShapeDtypeStruct(shape, jnp.int64 if jax.config.jax_enable_x64 else jnp.int32)
            compiled = built.step.lower(built.params, built.opt_state, x, x, 1, jnp.float32(0.0),
                                        jax.random.key(0)).compile()  # fmt: skip
        m = compiled.memory_analysis()
    except Exception:  # noqa: BLE001 - an analysis the backend lacks is no failure of the run
        return None
    if m is None:
        return None
    return {"argument_bytes": m.argument_size_in_bytes, "output_bytes": m.output_size_in_bytes,
            "temp_bytes": m.temp_size_in_bytes, "alias_bytes": m.alias_size_in_bytes}  # fmt: skip
