"""`train.compile auto`: whether to compile, and which mode, decided by timing this run's step.

Each mode is timed once per device, step and mode (a micro-batch eager and compiled, side by
side) and cached in `compile.json`; a run takes the mode that saves the most over its
micro-batches, its compile time included, or stays eager. `default` and `regional`
(AUTO_MODES) are timed for every run that could repay a compile; `max-autotune`
(AUTOTUNE_MODE), whose compile benchmarks inductor's own product kernels against ATen's and
takes minutes, only for runs long enough to repay that. How each mode compiles is
techniques/compile.py's.
"""

from __future__ import annotations

import contextlib
import dataclasses
import statistics
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch._dynamo.exc import BackendCompilerFailed

from onegpu.cache import cached, digest, entries, has, peek
from onegpu.config import Config, to_dict
from onegpu.models.protocol import LossFn
from onegpu.perf.contention import timed_cached
from onegpu.perf.devices import device_key, sync
from onegpu.techniques.compile import Candidate, release_cuda_graphs

AUTO_MODES = ("default", "regional")
"""What `auto` times against eager: the whole forward and loss as one graph (inductor fuses the
loss with its logits) and each block compiled once and reused (compile time flat in depth)."""
MIN_STEPS = 100
"""Shorter runs never time compile for `auto`: on a CPU it costs 20-60 s, which a short run does
not win back (docs/auto-defaults.md)."""


BEST_SPEEDUP = {"cpu": 1.15, "cuda": 2.0}
"""The most a compiled micro-batch is assumed faster than eager (eager / compiled) before this
machine has shown more: the bound that decides whether a trial is worth running at all. CPU:
the best inductor gave on our GPT on the EPYCs of docs/cpu-notes.md was below this (often
slower than eager). CUDA: a small model's eager step waits on the host's kernel launches,
which compiling fuses away. On the H200 (benchmarks/results/gpu-nvidia-h200-2026-11-28.md),
the compiled loop ran model A 1.65x faster than onegpu's eager step, and B 1.40x. Under the
earlier bound of 1.6, A's 5,000-step run could repay at most about 20 s of compiling, the
least assumed, so whether a trial ran turned on a few milliseconds of its eager micro-batch;
that file does not record which way it went."""
TRIAL_METHOD = 6
"""How `time_compile` times (6: as 5, whole-graph modes calling the C++ loss kernel as an op of
their graph, where dynamo had broken the graph around it, techniques/loss_kernels.py; 5: as 4,
regional compile compiling the block once, not once a block: 4's regional trials paid up to 8
compiles, techniques/bias_epilogue.py; 4: as 3, compiled
CPU linears adding their bias in oneDNN's epilogue; 3: eager and compiled side by side; 2 timed
eager on both sides of the compile, 1 before it only); part of the cache key, so trials timed
another way are made again rather than read."""
STORED_TRIAL = has("eager_step_s", "compiled_step_s", "compile_s")
"""What a trial stored in `compile.json` holds (a recorded failure or another format does not)."""
LEAST_COMPILE_S = {"cpu": 15.0, "cuda": 20.0}
"""The least a first compile is assumed to take before this machine has shown less."""

AUTOTUNE_MODE = "max-autotune"
"""The mode timed after AUTO_MODES, for long runs only. Its compile times inductor's GEMM
templates (on CPUs its C++ micro-kernels, AMX's where the CPU has it; on GPUs Triton's) against
ATen's product for each product of the step, and on GPUs records CUDA graphs: on the 2-core AMX
Xeon it compiled model B's step in 87 s, where default takes 15-40, and ran it no faster than
default (docs/floor.md)."""
AUTOTUNE_GAIN = {"cpu": 1.10, "cuda": 1.30}
"""The most max-autotune's micro-batch is assumed faster than the best of AUTO_MODES' (or than
eager, where none of them pays) until this machine's own trials show what it gains, more or
less: the bound that decides whether its trial is worth a long run's time. CPU: it gained nothing on model B on the AMX Xeon
(1.20x eager in turns, as default; 1.13x against default's 1.17x in rounds). CUDA: CUDA graphs
take a small model's kernel launches off the host, what a GPU's small steps wait on."""
LEAST_AUTOTUNE_S = {"cpu": 60.0, "cuda": 120.0}
"""The least max-autotune's compile is assumed to take before this machine has shown less."""


@dataclass(frozen=True, slots=True)
class CompileTrial:
    """One micro-batch's forward + backward, eager and compiled (`mode`), and what compiling
    cost; measured once per device, model, settings and mode, then read from the cache.
    `skipped`: why compiled was never timed (the run could not repay any compile), else ''.
    `others`: the other modes timed beside this one, for the run's first line."""

    eager_s: float
    compiled_s: float
    compile_s: float
    cached: bool = False
    skipped: str = ""
    mode: str = "default"
    others: tuple[CompileTrial, ...] = ()

    def compiled_at(self, eager_s: float) -> float:
        """The compiled micro-batch at this trial's speedup over an eager one of `eager_s`."""
        return eager_s * self.compiled_s / self.eager_s

    def saves(self, micro_steps: int, eager_s: float | None = None) -> float:
        """Seconds compiling saves over `micro_steps` micro-batches, its own cost taken off.
        With `eager_s`: its speedup (its own eager over compiled, timed together) applied to
        that eager step, so that modes timed at different moments of a machine whose speed
        moves are weighed on one eager step."""
        eager = self.eager_s if eager_s is None else eager_s
        return (eager - self.compiled_at(eager)) * micro_steps - self.compile_s

    def pays(self, micro_steps: int) -> bool:
        """Whether compiling saves more over `micro_steps` micro-batches than it costs."""
        return self.saves(micro_steps) > 0

    def as_dict(self) -> dict[str, Any]:
        d = {
            "eager_step_s": self.eager_s,
            "compiled_step_s": self.compiled_s,
            "compile_s": self.compile_s,
            "cached": self.cached,
            "mode": self.mode,
        }
        if self.others:
            d["others"] = [t.as_dict() for t in self.others]
        return d | ({"skipped": self.skipped} if self.skipped else {})


def _timed(fn: LossFn, model: nn.Module, batch, autocast, device: torch.device) -> float:
    sync(device)
    t0 = time.perf_counter()
    with autocast():
        loss = fn(model, *batch)
    loss.backward()
    sync(device)
    model.zero_grad(set_to_none=True)
    return time.perf_counter() - t0


PAIRS = 5
"""Eager and compiled micro-batches a compile trial times side by side, after the compile."""


def time_compile(
    model: nn.Module,
    eager: LossFn,
    candidate: Candidate,
    batch: tuple[torch.Tensor, torch.Tensor],
    autocast: Callable[[], contextlib.AbstractContextManager],
    device: torch.device,
) -> CompileTrial:
    """Run `batch` eagerly once (a warm-up), under the candidate mode once (the compile: its
    excess over a compiled run is the compile time), then PAIRS times eagerly and compiled side
    by side (the mode left and entered again in between: entering again compiles nothing), on
    the real model (gradients dropped after each run, RNG state restored). The speedup is the
    median of the pairs' ratios; the trial keeps the fastest eager run and the compiled time at
    that speedup. Side by side, because a shared VM's speed can halve for seconds
    (docs/cpu-notes.md): trials that timed eager and compiled in blocks a compile apart read one
    eager micro-batch at 1.44 s and at 0.63 s, and regional at 0.78 s compiled against 0.53 s
    eager, and chose by those moments."""
    pairs: list[tuple[float, float]] = []
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        _timed(eager, model, batch, autocast, device)
        try:
            first = _timed(candidate.enter(), model, batch, autocast, device)
            for _ in range(PAIRS):
                candidate.leave()
                eager_run = _timed(eager, model, batch, autocast, device)
                compiled_run = _timed(candidate.enter(), model, batch, autocast, device)
                pairs.append((eager_run, compiled_run))
        finally:
            candidate.leave()
    eager_s = min(e for e, _ in pairs)
    speedup = statistics.median(e / c for e, c in pairs)
    compile_s = max(0.0, first - min(c for _, c in pairs))
    return CompileTrial(eager_s, eager_s / speedup, compile_s)


def _trial(key: str, mode: str, measure: Callable[[], CompileTrial]) -> CompileTrial:
    """The trial of `mode` cached under `key`, measured (and stored) if absent."""
    ran: list[CompileTrial] = []

    def run() -> dict[str, float]:
        ran.append(measure())
        return {k: v for k, v in ran[0].as_dict().items() if k not in ("cached", "mode")}

    found = timed_cached(
        "compile.json",
        key,
        run,
        what=f"compile {mode} (train.compile auto)",
        valid=STORED_TRIAL,
    )
    if ran:
        return dataclasses.replace(ran[0], mode=mode)
    return CompileTrial(
        found["eager_step_s"], found["compiled_step_s"], found["compile_s"], True, mode=mode
    )


def trials_of(key: str, measures: dict[str, Callable[[], CompileTrial]]) -> list[CompileTrial]:
    """Each mode's trial cached under `key|mode`, run now (and stored) where absent."""
    return [_trial(f"{key}|{mode}", mode, measure) for mode, measure in measures.items()]


def best_of(trials: list[CompileTrial], micro_steps: int) -> tuple[str, CompileTrial]:
    """The trial that saves the most over `micro_steps` (each mode's speedup over its own eager
    runs, applied to the fastest eager micro-batch any trial saw), the others beside it; its
    mode, or 'none' where no mode saves anything: deterministic given the trials (the cache)
    and the run's length."""
    eager_s = min(t.eager_s for t in trials)  # each mode's speedup, on one eager step
    best = max(trials, key=lambda t: t.saves(micro_steps, eager_s))
    others = tuple(t for t in trials if t is not best)
    best = dataclasses.replace(best, others=others)
    return (best.mode if best.saves(micro_steps, eager_s) > 0 else "none"), best


def auto_candidate(cfg: Config, device: torch.device, distributed: bool) -> str:
    """`train.compile` as set, or for 'auto' the mode to time against eager: 'default' on a
    single-process CPU or CUDA run of at least MIN_STEPS steps without selective checkpointing,
    else 'none' (nothing to time)."""
    if cfg.train.compile != "auto":
        return cfg.train.compile
    if cfg.memory.checkpointing in ("selective", "dots"):  # the same policy context
        return "none"  # dynamo cannot trace its policy context here: nothing to time
    worth = cfg.train.max_steps >= MIN_STEPS and device.type in ("cpu", "cuda")
    return "default" if worth and not distributed else "none"


def repay_bound(device: torch.device, eager_s: float, micro_steps: int) -> tuple[float, float]:
    """(the most compiling could save over the run, the least it costs) on this device: this
    machine's own trials (its best speedup if above the assumed one, its quickest compile)
    where it has any, else BEST_SPEEDUP and LEAST_COMPILE_S."""
    here = device_key(device) + "|"
    trials = [
        t for k, t in entries("compile.json").items() if k.startswith(here) and STORED_TRIAL(t)
    ]
    speedup = max(
        [BEST_SPEEDUP.get(device.type, 1.5)]
        + [t["eager_step_s"] / t["compiled_step_s"] for t in trials if t["compiled_step_s"] > 0]
    )
    least = min(
        [t["compile_s"] for t in trials if t["compile_s"] > 0],
        default=LEAST_COMPILE_S.get(device.type, 20.0),
    )
    return eager_s * (1 - 1 / speedup) * micro_steps, least


def _eager_s(model: nn.Module, eager: LossFn, batch, autocast, device: torch.device) -> float:
    """One eager micro-batch's forward + backward, after a warm-up one (RNG restored)."""
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        _timed(eager, model, batch, autocast, device)
        return _timed(eager, model, batch, autocast, device)


def decide(
    cfg: Config,
    model: nn.Module,
    eager: LossFn,
    candidates: dict[str, Candidate],
    autocast: Callable[[], contextlib.AbstractContextManager],
    device: torch.device,
) -> tuple[str, CompileTrial]:
    """`train.compile auto` on the materialised model: eager or one of the `candidates`,
    whichever the timing (cached per device, step fingerprint and mode) says saves the most over
    this run's micro-batches. Each candidate is left after its timing: the caller enters the
    chosen one. Without a cached timing, one eager micro-batch is timed first: where the run
    could not repay the least compile time this machine has shown even at the best speedup it
    has shown, compiled is never timed (no compile spent on a run that cannot win it back).
    AUTOTUNE_MODE is timed after the others, where `autotune_worth` says the run is long
    enough."""
    key = f"{device_key(device)}|{step_fingerprint(cfg)}"
    micro_steps = cfg.train.max_steps * cfg.grad_accum_steps
    batch = trial_batch(cfg, model.vocab_size, device)
    modes = [mode for mode in candidates if mode != AUTOTUNE_MODE]
    if any(peek("compile.json", f"{key}|{mode}", valid=STORED_TRIAL) is None for mode in modes):
        eager_s = _eager_s(model, eager, batch, autocast, device)
        saves, costs = repay_bound(device, eager_s, micro_steps)
        if saves <= costs:
            why = (
                f"{micro_steps} micro-batches of {eager_s * 1e3:,.0f} ms could save at most "
                f"{saves:,.0f} s against at least {costs:,.0f} s of compiling"
            )
            nan = float("nan")
            return "none", CompileTrial(eager_s, nan, nan, skipped=why, mode="none")

    def measure(candidate: Candidate) -> Callable[[], CompileTrial]:
        return lambda: time_compile(model, eager, candidate, batch, autocast, device)

    trials = trials_of(key, {m: measure(candidates[m]) for m in modes})
    mode, best = best_of(trials, micro_steps)
    autotune = candidates.get(AUTOTUNE_MODE)
    if autotune is None or not autotune_worth(key, device, best, mode, micro_steps):
        return mode, best
    try:
        trials += trials_of(key, {AUTOTUNE_MODE: measure(autotune)})
    except BackendCompilerFailed as e:  # inductor could not build it: the run goes on without
        model.zero_grad(set_to_none=True)
        failed = f"{type(e).__name__}: {(str(e).strip().splitlines() or [''])[0][:200]}"
        cached("compile.json", f"{key}|{AUTOTUNE_MODE}", lambda: {"failed": failed}, refresh=True)
        warnings.warn(
            f"train.compile auto: {AUTOTUNE_MODE} failed to compile in its trial and is left "
            f"out, here and in later runs of this step ({failed})",
            stacklevel=1,
        )
        return mode, best
    mode, best = best_of(trials, micro_steps)
    if mode != AUTOTUNE_MODE and not trials[-1].cached:
        release_cuda_graphs(device)
    return mode, best


def autotune_worth(
    key: str, device: torch.device, best: CompileTrial, mode: str, micro_steps: int
) -> bool:
    """Whether AUTOTUNE_MODE is timed for this run: where its trial is cached (free to weigh),
    or where its least compile time is below what it could save over the run's micro-batches
    at its best gain over `best` (the mode AUTO_MODES' trials chose, or eager)."""
    if peek("compile.json", f"{key}|{AUTOTUNE_MODE}", valid=STORED_TRIAL) is not None:
        return True
    if peek("compile.json", f"{key}|{AUTOTUNE_MODE}", valid=has(text=("failed",))) is not None:
        return False  # failed to compile here before
    if device.type not in AUTOTUNE_GAIN:
        return False
    trials = (best, *best.others)
    eager_s = min(t.eager_s for t in trials)
    run_s = best.compiled_at(eager_s) if mode != "none" else eager_s
    saves, costs = autotune_bound(device, run_s, micro_steps)
    return saves > costs


def autotune_bound(device: torch.device, run_s: float, micro_steps: int) -> tuple[float, float]:
    """(the most AUTOTUNE_MODE could save over `micro_steps` micro-batches of `run_s`, the
    least its compile costs) on this device: the best gain this machine's own trials showed over
    the other modes of the same step (a gain below 1 where it only lost: then it is not timed
    again for another step), else the assumed AUTOTUNE_GAIN; the quickest max-autotune compile
    it has shown, else LEAST_AUTOTUNE_S."""
    here, tail = device_key(device) + "|", "|" + AUTOTUNE_MODE
    found = {
        k: t for k, t in entries("compile.json").items() if k.startswith(here) and STORED_TRIAL(t)
    }
    gains, compiles = [], []
    for k, tuned in found.items():
        if not k.endswith(tail) or tuned["compiled_step_s"] <= 0:
            continue
        compiles.append(tuned["compile_s"])
        step = k[: -len(tail)]
        speedups = [
            t["eager_step_s"] / t["compiled_step_s"]
            for m in AUTO_MODES
            if (t := found.get(f"{step}|{m}")) and t["compiled_step_s"] > 0
        ]
        tuned_speedup = tuned["eager_step_s"] / tuned["compiled_step_s"]
        gains.append(tuned_speedup / max([1.0, *speedups]))
    least = min([c for c in compiles if c > 0], default=LEAST_AUTOTUNE_S[device.type])
    gain = max(gains, default=AUTOTUNE_GAIN[device.type])
    return run_s * (1 - 1 / gain) * micro_steps, least


def step_fingerprint(cfg: Config) -> str:
    """What a micro-batch's forward and backward depend on, as a short stable key."""
    d = to_dict(cfg)
    what = {
        "model": d["model"],
        "memory": d["memory"],
        "precision": cfg.train.precision,
        "loss_kernel": cfg.train.loss_kernel,
        "batch": [cfg.train.micro_batch_size, cfg.train_seq_len],
        "trial": TRIAL_METHOD,
    }
    if cfg.train.gelu_kernel == "compiled":  # the eager step it is timed against (eager keeps
        what["gelu_kernel"] = "compiled"  # the keys cached before the setting existed)
    return digest(what)


def trial_batch(cfg: Config, out_vocab: int, device: torch.device):
    """A micro-batch of random tokens of the run's shape (targets below `out_vocab`, the
    model's output size)."""
    g = torch.Generator().manual_seed(0)
    shape = (cfg.train.micro_batch_size, cfg.train_seq_len)
    x = torch.randint(0, cfg.model.vocab_size, shape, generator=g)
    y = torch.randint(0, out_vocab, shape, generator=g)
    return x.to(device), y.to(device)
