"""`train.xla_flags`: XLA's CPU options for the JAX backend, chosen by measurement.

XLA's CPU backend has several paths for the step's products: its own (the default), oneDNN
(`--xla_cpu_use_onednn=true`) and YNNPACK's dot fusion. Which is fastest depends on the CPU:
on a 2-core AVX512-BF16 EPYC, model B's step ran 1,661-1,734 tokens/s in fp32 with the
defaults, 1,598-1,628 with oneDNN and 1,033-1,133 with the dot fusion
(benchmarks/results/xla-cpu-flags-B-2026-11-28.md), while on AMX Xeons oneDNN is the path to
the AMX tiles. So `auto` measures instead of assuming.

XLA reads XLA_FLAGS once, when its first backend starts, so each setting is timed in a process
of its own: a short run of the same configuration (`onegpu train` for TRIAL_STEPS steps, its
steady step time from summary.json). A run of at least MIN_STEPS steps pays that once per
machine, jax version and run shape (cached in `xla-flags.json`); shorter runs take a cached
choice or XLA's defaults. The flags are then set in this process's XLA_FLAGS before XLA starts.
Flags the user put in XLA_FLAGS are theirs: `auto` leaves them alone.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.metadata
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from onegpu.cache import cached, has, peek
from onegpu.config import Config, ConfigError, to_dict
from onegpu.config.backends import XLA_CPU_SETTINGS, xla_flags_of
from onegpu.config.loading import to_toml
from onegpu.perf.cpu import hardware_key, read_cpuinfo

CACHE_FILE = "xla-flags.json"
MIN_STEPS = 1000
"""Runs shorter than this never time the settings: three short runs (about a minute and a
half at model B's shape on 2 cores) are not won back by a few percent over a short run."""
TRIAL_STEPS = 6
"""Steps of each trial run: the first holds XLA's compilation, the medians of the rest count."""
MIN_GAIN = 1.03
"""A setting replaces XLA's defaults only where its step is this much faster."""


def xla_started() -> bool:
    """Whether a JAX backend exists in this process (XLA_FLAGS has been read)."""
    from jax._src import xla_bridge

    return bool(xla_bridge._backends)


def _gpu_plugin() -> bool:
    """Whether JAX will find an accelerator: a CUDA or ROCm plugin installed, unless
    JAX_PLATFORMS says cpu. Asked without starting XLA, which would read XLA_FLAGS."""
    platforms = os.environ.get("JAX_PLATFORMS", "")
    if platforms:
        return platforms.split(",")[0] != "cpu"
    names = {(d.metadata["Name"] or "").lower() for d in importlib.metadata.distributions()}
    return any(n.startswith(("jax-cuda", "jax_cuda", "jax-rocm", "jax_rocm")) for n in names)


def run_key(cfg: Config) -> str:
    """What a setting's step time depends on: the machine, threads, jax and the run's shape."""
    import jax

    what = {
        "model": to_dict(cfg)["model"],
        "micro_batch_size": cfg.train.micro_batch_size,
        "batch_size": cfg.train.batch_size,
        "seq_len": cfg.train_seq_len,
        "precision": cfg.train.precision,
        "memory": to_dict(cfg)["memory"],
        "optim": cfg.optim.name,
    }
    digest = hashlib.sha256(json.dumps(what, sort_keys=True).encode()).hexdigest()[:16]
    return f"{hardware_key(read_cpuinfo())}|threads={os.cpu_count()}|jax={jax.__version__}|{digest}"


def _trial(cfg_toml: Path, setting: str, folder: Path) -> float | None:
    """Steady step seconds of a short run under `setting`; None where it failed (a flag this
    jaxlib does not know aborts XLA at start)."""
    run = folder / setting
    cmd = [sys.executable, "-m", "onegpu", "train", "--config", str(cfg_toml),
           "--train.xla_flags", setting, "--train.max_steps", str(TRIAL_STEPS),
           "--train.log_every", "1", "--train.eval_every", "0", "--out.dir", str(run),
           "--out.progress", "false", "--out.save_checkpoint", "false",
           "--out.tensorboard", "false"]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    summary = run / "summary.json"
    if proc.returncode != 0 or not summary.exists():
        return None
    return json.loads(summary.read_text()).get("step_time_s")


def measure_settings(cfg: Config) -> dict[str, Any]:
    """Each of XLA_CPU_SETTINGS timed in a short run of its own; the choice and the times."""
    with tempfile.TemporaryDirectory(prefix="onegpu-xla-") as tmp:
        folder = Path(tmp)
        trial_cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, resume=""))
        (folder / "config.toml").write_text(to_toml(trial_cfg))
        step_s = {name: _trial(folder / "config.toml", name, folder) for name in XLA_CPU_SETTINGS}
    return {"choice": choose(step_s), "step_s": step_s}


def _valid(found: Any) -> bool:
    """A stored trial: a known setting chosen, and the times it was chosen from."""
    return (
        has(text=("choice",))(found)
        and found["choice"] in XLA_CPU_SETTINGS
        and isinstance(found.get("step_s"), dict)
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
        return XlaFlags("none", "XLA_FLAGS set by the user")
    if xla_started():  # a run inside a process that used JAX before: too late for flags
        return XlaFlags("none", "XLA started before the run")
    if _gpu_plugin():
        return XlaFlags("none", "not a CPU run")
    key = run_key(cfg)
    if cfg.train.max_steps < MIN_STEPS:
        found = peek(CACHE_FILE, key, _valid)
        if found:
            return XlaFlags(found["choice"], "cached", found["step_s"])
        return XlaFlags("none", f"auto: under {MIN_STEPS} steps, untimed")
    found = cached(CACHE_FILE, key, lambda: measure_settings(cfg), valid=_valid)
    return XlaFlags(found["choice"], "auto: timed", found["step_s"])


def check_flags_known(flags: str) -> None:
    """ConfigError where XLA would not start with `flags`: it aborts the whole process on a
    flag it does not know, so flags given by hand are tried first in a process of their own."""
    env = {**os.environ, "XLA_FLAGS": f"{os.environ.get('XLA_FLAGS', '')} {flags}".strip()}
    probe = "import jax; jax.devices()"
    proc = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        said = [line for line in proc.stderr.splitlines() if "XLA_FLAGS" in line]
        why = (
            said[-1].split("] ", 1)[-1] if said else f"XLA failed to start (exit {proc.returncode})"
        )
        raise ConfigError(
            "train.xla_flags",
            f"{why}; give flags this jaxlib knows, or one of {', '.join(XLA_CPU_SETTINGS)}",
        )


def apply_xla_flags(cfg: Config) -> tuple[Config, XlaFlags]:
    """Decide `train.xla_flags`, add its flags to XLA_FLAGS before XLA starts, and return the
    config holding the choice (config.toml; a resume keeps it)."""
    decided = decide(cfg)
    flags = xla_flags_of(decided.setting)
    if flags:
        if xla_started():
            raise ConfigError(
                "train.xla_flags",
                "XLA has already started in this process and read its flags; run in a new "
                "process, or set it to none",
            )
        if decided.setting not in XLA_CPU_SETTINGS:
            check_flags_known(flags)
        os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {flags}".strip()
    train = dataclasses.replace(cfg.train, xla_flags=decided.setting)
    return dataclasses.replace(cfg, train=train), decided
