"""`train.xla_flags`: XLA's CPU options for the JAX backend, chosen by measurement.

XLA's CPU backend has several paths for the step's products: its own (the default), oneDNN
(`--xla_cpu_use_onednn=true`) and YNNPACK's dot fusion. Which is fastest depends on the CPU:
on a 2-core AVX512-BF16 EPYC, model B's step ran 1,661-1,734 tokens/s in fp32 with the
defaults, 1,598-1,628 with oneDNN and 1,033-1,133 with the dot fusion
(benchmarks/results/xla-cpu-flags-B-2026-11-28.md); an earlier measurement on the default
`small` model had oneDNN 5-7% ahead (xla-cpu-flags-bf16cpu.md). So `auto` measures instead of
assuming.

XLA reads XLA_FLAGS once, when its first backend starts, so each setting is timed in a process
of its own: a short run of the same configuration (`onegpu train` for TRIAL_STEPS steps, its
steady step time from summary.json). A run of at least MIN_STEPS steps pays that once per
machine, jax version and run shape (cached in `xla-flags.json`); shorter runs take a cached
choice or XLA's defaults. The flags are then set in this process's XLA_FLAGS before XLA starts.
Flags the user put in XLA_FLAGS are theirs: `auto` leaves them alone.
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from onegpu.cache import cached, digest, has, peek
from onegpu.config import Config, ConfigError, to_dict
from onegpu.config.backends import XLA_CPU_SETTINGS, xla_flags_of
from onegpu.config.loading import to_toml
from onegpu.perf.allocator import active_allocator
from onegpu.perf.cpu import hardware_key, read_cpuinfo

CACHE_FILE = "xla-flags.json"
MIN_STEPS = 1000
"""Runs shorter than this never time the settings: three short runs (about a minute and a
half at model B's shape on 2 cores) are not won back by a few percent over a short run."""
TRIAL_STEPS = 6
"""Steps of each trial run: the first holds XLA's compilation, the medians of the rest count."""
MIN_GAIN = 1.05
"""A setting replaces XLA's defaults only where its step is this much faster: above the 4% two
runs of the same setting differed by (xla-cpu-flags-B-2026-11-28.md), as each is one run."""
TRIAL_TIMEOUT_S = 600
"""A trial run that takes longer than this counts as failed (a hung child never hangs the run)."""


def xla_started() -> bool:
    """Whether a JAX backend exists in this process (XLA_FLAGS has been read)."""
    from jax._src import xla_bridge

    return xla_bridge.backends_are_initialized()


def _accelerator_plugin() -> bool:
    """Whether JAX will find an accelerator, asked without starting XLA (which would read
    XLA_FLAGS): JAX_PLATFORMS where set, else any installed PJRT plugin (CUDA, ROCm, Metal:
    entry points of group jax_plugins) or libtpu."""
    platforms = os.environ.get("JAX_PLATFORMS", "")
    if platforms:
        return platforms.split(",")[0] != "cpu"
    if importlib.metadata.entry_points(group="jax_plugins"):
        return True
    return importlib.util.find_spec("libtpu") is not None


def with_flags(flags: str) -> str:
    """XLA_FLAGS as it is in this process, with `flags` added."""
    return f"{os.environ.get('XLA_FLAGS', '')} {flags}".strip()


def machine_key() -> str:
    """The CPU, the threads this process may use, jax and XLA_FLAGS: what a timing of XLA's
    CPU code depends on beyond the shapes (jax-precision.json, loss_chunk.json and this
    module's own trials)."""
    import jax

    threads = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return (
        f"{hardware_key(read_cpuinfo())}|threads={threads}|jax={jax.__version__}"
        f"|XLA_FLAGS={os.environ.get('XLA_FLAGS', '')}"
    )


def run_key(cfg: Config) -> str:
    """What a setting's step time depends on: the machine, the allocator and the run's shape."""
    d = to_dict(cfg)
    what = {
        "model": d["model"],
        "micro_batch_size": cfg.train.micro_batch_size,
        "batch_size": cfg.train.batch_size,
        "seq_len": cfg.train_seq_len,
        "packing": cfg.data.packing,
        "precision": cfg.train.precision,
        "memory": d["memory"],
        "optim": d["optim"],
    }
    return f"{machine_key()}|allocator={active_allocator()}|{digest(what)}"


def _trial(cfg_toml: Path, setting: str, folder: Path) -> tuple[float | None, str]:
    """(steady step seconds of a short run under `setting`, or None where it failed: a flag
    this jaxlib does not know aborts XLA at start; the last line it printed)."""
    run = folder / setting
    options = {
        "--config": str(cfg_toml),
        "--train.xla_flags": setting,
        "--train.max_steps": str(TRIAL_STEPS),
        "--train.log_every": "1",
        "--train.eval_every": "0",
        "--out.dir": str(run),
        "--out.progress": "false",
        "--out.save_checkpoint": "false",
        "--out.tensorboard": "false",
    }
    cmd = [sys.executable, "-m", "onegpu", "train", *(x for kv in options.items() for x in kv)]
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    try:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=TRIAL_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return None, f"over {TRIAL_TIMEOUT_S} s"
    summary = run / "summary.json"
    if proc.returncode != 0 or not summary.exists():
        said = proc.stderr.strip().splitlines()
        return None, said[-1][-300:] if said else f"exit {proc.returncode}"
    return json.loads(summary.read_text()).get("step_time_s"), ""


def measure_settings(cfg: Config) -> dict[str, Any]:
    """Each of XLA_CPU_SETTINGS timed in a short run of its own; the choice, the times, why a
    trial failed, and what the trials cost."""
    print(
        f"onegpu: timing XLA's CPU settings ({', '.join(XLA_CPU_SETTINGS)}) for this machine "
        f"and shape: {len(XLA_CPU_SETTINGS)} runs of {TRIAL_STEPS} steps, once (xla-flags.json)",
        file=sys.stderr,
    )
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="onegpu-xla-") as tmp:
        folder = Path(tmp)
        trial_cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, resume=""))
        (folder / "config.toml").write_text(to_toml(trial_cfg))
        ran = {name: _trial(folder / "config.toml", name, folder) for name in XLA_CPU_SETTINGS}
    step_s = {name: s for name, (s, _) in ran.items()}
    failed = {name: why for name, (s, why) in ran.items() if s is None}
    return {
        "choice": choose(step_s),
        "step_s": step_s,
        "failed": failed,
        "trials_s": time.perf_counter() - t0,
    }


def _valid(found: Any) -> bool:
    """A stored trial: a known setting chosen, from times where XLA's defaults ran (a trial
    whose baseline failed is measured again next time, not kept)."""
    step_s = found.get("step_s") if isinstance(found, dict) else None
    return (
        has(text=("choice",))(found)
        and found["choice"] in XLA_CPU_SETTINGS
        and isinstance(step_s, dict)
        and isinstance(step_s.get("none"), (int, float))
    )


def choose(step_s: dict[str, float | None]) -> str:
    """The fastest setting where it beats XLA's defaults by MIN_GAIN, else 'none'."""
    timed = {name: s for name, s in step_s.items() if s}
    base = timed.get("none")
    if not base:
        return "none"
    best = min(timed, key=timed.__getitem__)
    return best if timed[best] * MIN_GAIN <= base else "none"


@dataclasses.dataclass(frozen=True, slots=True)
class XlaFlags:
    """What `train.xla_flags` came to: the setting (a name or flags), why, and the trial's
    step times where there was one."""

    setting: str
    reason: str
    step_s: dict[str, float | None] = dataclasses.field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return {"setting": self.setting, "reason": self.reason, "step_s": self.step_s}

    def line(self) -> str:
        """For the run's first line."""
        times = ", ".join(
            f"{n} {s * 1e3:,.1f} ms" if s else f"{n} failed" for n, s in self.step_s.items()
        )
        return f"xla_flags {self.setting} ({self.reason}{': ' + times if times else ''})"


def decide(cfg: Config) -> XlaFlags:
    """`train.xla_flags` for this run (see the module's docstring), nothing applied yet."""
    setting = cfg.train.xla_flags
    if setting != "auto":
        return XlaFlags(setting, "set")
    if os.environ.get("XLA_FLAGS"):
        return XlaFlags("none", "XLA_FLAGS set before the run")
    if xla_started():  # a run inside a process that used JAX before: too late for flags
        return XlaFlags("none", "XLA started before the run")
    if _accelerator_plugin():
        return XlaFlags("none", "not a CPU run")
    key = run_key(cfg)
    if cfg.train.max_steps < MIN_STEPS:
        found = peek(CACHE_FILE, key, _valid)
        if found:
            return XlaFlags(found["choice"], "cached", found["step_s"])
        return XlaFlags("none", f"auto: under {MIN_STEPS} steps, untimed")
    found = cached(CACHE_FILE, key, lambda: measure_settings(cfg), valid=_valid)
    return XlaFlags(found["choice"], "auto: timed", found["step_s"])


def _probe(flags: str) -> str:
    """'' where XLA starts with `flags` added, else why not (its last line about them)."""
    probe = "import jax; jax.devices()"
    env = {**os.environ, "XLA_FLAGS": with_flags(flags)}
    proc = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True)
    if proc.returncode == 0:
        return ""
    said = [line for line in proc.stderr.splitlines() if "XLA_FLAGS" in line]
    return said[-1].split("] ", 1)[-1] if said else f"XLA failed to start (exit {proc.returncode})"


def check_flags_known(flags: str) -> None:
    """ConfigError where XLA would not start with `flags`: it aborts the whole process on a
    flag it does not know, so flags are tried first in a process of their own (once per
    machine, jax version and flags: cached)."""
    import jax

    key = f"known|jax={jax.__version__}|XLA_FLAGS={with_flags(flags)}"
    why = cached(CACHE_FILE, key, lambda: {"why": _probe(flags)}, valid=has(text=("why",)))["why"]
    if why:
        raise ConfigError(
            "train.xla_flags",
            f"{why}; give flags this jaxlib knows, or one of {', '.join(XLA_CPU_SETTINGS)}",
        )


def apply_xla_flags(cfg: Config) -> tuple[Config, XlaFlags]:
    """Decide `train.xla_flags`, add its flags to XLA_FLAGS before XLA starts, and return the
    config holding the choice (config.toml; a resume keeps it)."""
    decided = decide(cfg)
    flags = xla_flags_of(decided.setting)
    current = os.environ.get("XLA_FLAGS", "").split()
    if flags and not all(f in current for f in flags.split()):  # in place already: nothing to do
        check_flags_known(flags)
        if xla_started():
            raise ConfigError(
                "train.xla_flags",
                "XLA has already started in this process and read its flags; run in a new "
                "process, or set it to none",
            )
        os.environ["XLA_FLAGS"] = with_flags(flags)
    train = dataclasses.replace(cfg.train, xla_flags=decided.setting)
    return dataclasses.replace(cfg, train=train), decided
