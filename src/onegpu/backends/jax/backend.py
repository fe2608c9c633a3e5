"""The JAX backend of the run lifecycle (runs/backend.py): onegpu's GPT in Flax with optax,
over the same batches in the same order, writing the same run folder (model.safetensors in the
torch GPT's layout). The lifecycle (runs/lifecycle.py) drives it exactly as it drives torch.
No torch import."""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from onegpu.backends.jax import checkpoint as ckpt
from onegpu.backends.jax.build import JaxBuilt, build
from onegpu.backends.jax.totals import HostTotals, Out, peak_rss_bytes
from onegpu.config import Config, ConfigError, to_dict
from onegpu.config.schedule import lr_at, scaled_optim
from onegpu.data.windows import IGNORE_INDEX, eval_windows, train_windows
from onegpu.perf.allocator import active_allocator
from onegpu.perf.host_memory import available_host_bytes
from onegpu.perf.peaks import cached_cpu_peak
from onegpu.runs import checkpoints
from onegpu.runs.backend import OneProcess, Stepped, no_guard
from onegpu.runs.checkpoints import Checkpoint
from onegpu.runs.folder import RunFolder, environment
from onegpu.runs.meter import Meter


class JaxBackend:
    name = "jax"
    checkpoint_suffix = ckpt.SUFFIX

    def __init__(self) -> None:
        self.built: JaxBuilt | None = None
        self._compile_s = 0.0
        self.tokenizer: Any = None
        self.chat_template: str | None = None
        self._batches: Iterator | None = None
        self._val: list = []
        self._key: Any = None

    @contextlib.contextmanager
    def processes(self, cfg: Config) -> Iterator[OneProcess]:
        yield OneProcess()  # the JAX backend trains on one process (config/backends.py)

    def check_memory(self, cfg: Config) -> None:
        pass  # against XLA's own memory analysis, once the step is compiled (start)

    def build(self, cfg: Config) -> Config:
        self.built = build(cfg)
        self.tokenizer = self.built.data.tokenizer
        self.chat_template = self.built.data.chat_template
        # compiled once, ahead, for a step's shapes: the memory check reads XLA's analysis of
        # this very executable before anything is written, and so does the summary later
        t0 = time.perf_counter()
        self.built.step = lower(self.built).compile()
        self._compile_s = time.perf_counter() - t0  # before the meter's clock starts
        check_fits(self.built)
        return self.built.cfg  # every auto decided: config.toml and checkpoints hold the choices

    def data_fingerprint(self) -> str | None:
        return self.built.data.fingerprint()

    def read_checkpoint(self, path: Path) -> dict[str, Any]:
        return ckpt.read(path)

    def load_state(self, checkpoint: Checkpoint) -> None:
        b, saved = self.built, checkpoint.state
        b.params = jax.tree_util.tree_map(jnp.asarray, ckpt.restore(b.params, saved["params"]))
        b.opt_state = jax.tree_util.tree_map(
            jnp.asarray, ckpt.restore(b.opt_state, saved["opt_state"])
        )
        del saved["params"], saved["opt_state"]  # restored: no second copy for the whole run

    def start(self, step: int) -> None:
        b, t = self.built, self.built.cfg.train
        self._batches = batches(b, step)
        self._val = (
            eval_windows(
                b.data.val_rows,
                batch_size=t.micro_batch_size,
                n_batches=t.eval_batches,
            )
            if t.eval_every
            else []
        )
        self._key = jax.random.key(t.seed)

    def meter(self) -> Meter:
        b = self.built
        peak = cached_cpu_peak(b.precision.name) if jax.default_backend() == "cpu" else None
        # JAX dispatches asynchronously: the meter's clock waits for the step's results
        return Meter(
            HostTotals(),
            b.flops_per_token,
            peak,
            peak_memory=peak_rss_bytes,
            sync=lambda: jax.block_until_ready(b.params),
        )

    def describe(self, out_dir: Path, start: int) -> str:
        b, cfg = self.built, self.built.cfg
        resumed = f" | resumed at step {start}" if start else ""
        scan = " | layers scanned" if cfg.model.scan_layers else ""
        return (
            f"onegpu: {b.n_params:,} parameters | jax {jax.__version__} on "
            f"{jax.devices()[0].platform} | {b.precision.name}{scan} | batch "
            f"{cfg.train.batch_size}x{cfg.train_seq_len} tokens in {b.n_micro} "
            f"micro-batch(es) | {b.xla.line()} | data {b.data.description}{b.data.rows_note()} "
            f"| run folder {out_dir}{resumed}"
        )

    def seed(self, checkpoint: Checkpoint | None) -> None:
        pass  # dropout's key is folded from (seed, step): nothing to restore

    def guard(self, run: RunFolder, meter: Meter) -> contextlib.AbstractContextManager[None]:
        return no_guard()

    def step(self, step: int) -> Stepped:
        b = self.built
        x, y, positions, n_tokens = next(self._batches)
        lr = lr_at(step, scaled_optim(b.cfg), b.cfg.train.max_steps)
        key = jax.random.fold_in(self._key, step)
        b.params, b.opt_state, out = b.step(
            b.params, b.opt_state, x, y, positions, n_tokens, jnp.float32(lr), key
        )
        return Stepped(Out(out.loss, out.grad_norm, out.skipped, lr), x.size, n_tokens)

    def evaluate(self) -> float:
        total, count = 0.0, 0
        for x, y, *positions in self._val:
            loss, n = self.built.evaluate(self.built.params, x, y, *positions)
            total, count = total + float(loss), count + int(n)
        return total / max(count, 1)

    def weights_finite(self) -> bool:
        leaves = jax.tree_util.tree_leaves(self.built.params)
        return bool(all(jnp.isfinite(p).all() for p in leaves))

    def write_checkpoint(
        self, path: Path, common: dict[str, Any], *, wait: bool
    ) -> Callable[[], None] | None:
        state = {
            **common,
            "params": jax.device_get(self.built.params),
            "opt_state": jax.device_get(self.built.opt_state),
        }
        checkpoints.write_atomic(path, lambda f: ckpt.write(f, state))
        return None

    def final_weights(self, path: Path) -> None:
        from onegpu.backends.jax.weights import write_safetensors

        write_safetensors(jax.device_get(self.built.params), self.built.cfg.model, path)

    def summary(self, meter: Meter, step_s: float | None, interrupted: bool) -> dict[str, Any]:
        b = self.built
        xla = xla_memory(b)
        return {
            "params": b.n_params,
            "compiled": True,  # XLA compiles every step: the first step's excess is that
            "compile_before_s": self._compile_s,
            "peak_mem_bytes": peak_rss_bytes(),
            "peak_mem_kind": "process peak RSS",
            "xla_memory": xla,
            # the step's buffers as XLA planned them: what `onegpu bench` compares across rows
            "memory": {
                "peak": xla_total(xla),
                "kind": "XLA memory analysis (arguments + outputs + temporaries - aliased)",
            }
            if xla
            else None,
            "precision": b.precision.name,
            "xla_flags": b.xla.as_dict() | {"XLA_FLAGS": os.environ.get("XLA_FLAGS", "")},
            "device": jax.default_backend(),
            "device_name": str(jax.devices()[0].device_kind),
            "config": to_dict(b.cfg),
            "data": b.data.report(),
            "environment": environment(
                jax=jax.__version__,
                jax_platform=jax.default_backend(),
                allocator=active_allocator(),
            ),
        }

    def finished(self, summary: dict[str, Any]) -> None:
        pass


def batches(built: JaxBuilt, start: int) -> Iterator[tuple[Any, ...]]:
    """(inputs, targets, positions, target count) of each step from `start` on, split into
    micro-batches: the torch backend's rows in the torch backend's order; positions None
    where rows hold one document each."""
    cfg, t = built.cfg, built.cfg.train
    T, n = cfg.train_seq_len, built.n_micro
    for x, y, *positions in train_windows(
        built.data.train_rows,
        batch_size=t.batch_size,
        seed=t.seed,
        start=start * t.batch_size,
    ):
        n_tokens = int(np.count_nonzero(y != IGNORE_INDEX))
        packed = positions[0].reshape(n, -1, T) if positions else None
        yield x.reshape(n, -1, T), y.reshape(n, -1, T), packed, n_tokens


def check_fits(built: JaxBuilt) -> None:
    """The compiled step's buffers (XLA's own analysis) against the memory available now: a
    step that cannot fit is refused before its first run; one XLA cannot analyse starts."""
    if built.cfg.train.skip_memory_check or jax.default_backend() != "cpu":
        return  # an accelerator's analysis is its own device's; XLA refuses what it cannot fit
    xla = xla_memory(built)
    if not xla:
        print("onegpu: memory check skipped: XLA gave no memory analysis of the step", flush=True)
        return
    # what the step allocates beyond its arguments (parameters, optimizer state and batch are
    # in memory already, and so out of what is available)
    need = xla["output_bytes"] + xla["temp_bytes"] - xla["alias_bytes"]
    free = available_host_bytes()
    if need > free:
        raise ConfigError(
            "train.skip_memory_check",
            f"XLA plans {need / 2**30:.1f} GiB for one step and {free / 2**30:.1f} GiB are "
            "available: lower train.micro_batch_size, use memory.checkpointing block with "
            "model.scan_layers true, or skip this check with --train.skip_memory_check true",
        )


def xla_total(m: dict[str, int]) -> int:
    return m["argument_bytes"] + m["output_bytes"] + m["temp_bytes"] - m["alias_bytes"]


def lower(built: JaxBuilt) -> Any:
    """The step lowered for the shapes of one step's batch (what `start`'s batches are)."""
    cfg, t = built.cfg, built.cfg.train
    shape = (built.n_micro, t.micro_batch_size, cfg.train_seq_len)
    x = jax.ShapeDtypeStruct(shape, jnp.int64 if jax.config.jax_enable_x64 else jnp.int32)
    positions = x if built.data.train_rows.isolated else None  # packed rows' positions
    return built.step.lower(
        built.params, built.opt_state, x, x, positions, 1, jnp.float32(0.0), jax.random.key(0)
    )


def xla_memory(built: JaxBuilt) -> dict[str, int] | None:
    """XLA's compiled memory analysis of the step: argument, output and temporary bytes (from
    the executable the run compiled, else compiled here for the shapes of a step)."""
    compiled = built.step
    try:
        if not hasattr(compiled, "memory_analysis"):
            compiled = lower(built).compile()
        m = compiled.memory_analysis()
    except Exception:  # noqa: BLE001 - an analysis the backend lacks is no failure of the run
        return None
    if m is None:
        return None
    return {
        "argument_bytes": m.argument_size_in_bytes,
        "output_bytes": m.output_size_in_bytes,
        "temp_bytes": m.temp_size_in_bytes,
        "alias_bytes": m.alias_size_in_bytes,
    }
