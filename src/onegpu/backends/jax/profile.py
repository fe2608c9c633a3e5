"""`onegpu profile --train.backend jax`: a few steps under `jax.profiler`, written as a Perfetto
trace (`perfetto_trace.json.gz`, open it at ui.perfetto.dev) beside TensorBoard's profile
files, with the step time and XLA's memory analysis in summary.txt."""

from __future__ import annotations

import statistics
import time
from pathlib import Path
from typing import Any

from onegpu.backends.jax import require_jax
from onegpu.config import Config, ConfigError
from onegpu.runs.folder import resolve_out_dir
from onegpu.runs.lock import release_run_folder


def profile_jax(cfg: Config, *, steps: int = 3, warmup: int = 2) -> dict[str, Any]:
    if steps < 1:
        raise ConfigError("--steps", f"must be at least 1 profiled step, got {steps}")
    require_jax()
    import jax
    import jax.numpy as jnp

    from onegpu.backends.jax.backend import batches, xla_memory
    from onegpu.backends.jax.build import build
    from onegpu.config.schedule import lr_at, scaled_optim

    out = resolve_out_dir(cfg.out)
    try:
        built = build(cfg)
        stream = batches(built, 0)
        key = jax.random.key(cfg.train.seed)

        def one_step(step: int) -> None:
            x, y, positions, n = next(stream)
            lr = jnp.float32(lr_at(step, scaled_optim(cfg), cfg.train.max_steps))
            key_i = jax.random.fold_in(key, step)
            built.params, built.opt_state, got = built.step(
                built.params, built.opt_state, x, y, positions, n, lr, key_i
            )
            jax.block_until_ready(got)

        for step in range(max(1, warmup)):  # the first call compiles: never profiled
            one_step(step)
        times = []
        with jax.profiler.trace(str(out), create_perfetto_trace=True):
            for step in range(max(1, warmup), max(1, warmup) + steps):
                t0 = time.perf_counter()
                with jax.profiler.StepTraceAnnotation("train", step_num=step):
                    one_step(step)
                times.append(time.perf_counter() - t0)
    finally:
        release_run_folder(out)
    step_s = statistics.median(times)
    tokens = cfg.train.batch_size * cfg.train_seq_len
    traces = sorted(str(p.relative_to(out)) for p in Path(out).rglob("*.json.gz"))
    mem = xla_memory(built) or {}
    lines = [
        f"onegpu profile (jax {jax.__version__}, {jax.default_backend()}): {built.n_params:,} "
        f"parameters, {built.precision.name}, batch {cfg.train.batch_size}x{cfg.train_seq_len} in "
        f"{built.n_micro} micro-batch(es), {steps} profiled steps",
        f"step time (median of profiled steps): {step_s * 1e3:.1f} ms -> {tokens / step_s:,.0f} "
        "tokens/s (under the profiler)",
        "XLA memory analysis of the step: "
        + ", ".join(f"{k} {v / 2**20:,.1f} MiB" for k, v in mem.items()),
        "Perfetto trace: " + (", ".join(traces) or "none written"),
    ]
    summary = "\n".join(lines) + "\n"
    (Path(out) / "summary.txt").write_text(summary)
    return {"summary": summary, "out_dir": out, "traces": traces}
