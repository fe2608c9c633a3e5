"""torch.compile, whole or regional, applied after every module change (backends/torch/model.py's order).

- 'default' / 'max-autotune': the loss function (forward, output layer and cross-entropy) is
  compiled as one graph, so inductor can fuse the loss with the logits it consumes.
- 'regional': each transformer block is compiled in place (`nn.Module.compile`). The blocks run
  the same code on same-shaped inputs, so dynamo compiles the first one and reuses the result
  for the others: compile time does not grow with depth (what `nn.scan` over layers does in JAX,
  as Lippe's "Profiling and Scaling Single-GPU Transformer Models" shows). Embeddings, final
  norm and loss stay eager.

'default' and 'regional' graphs add a CPU linear's bias in oneDNN's GEMM epilogue rather than
copying it in first (techniques/bias_epilogue.py).

Compilation is lazy: nothing is compiled until the first step runs.
"""

from __future__ import annotations

import contextlib
import dataclasses
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from onegpu.cache import digest, entries, has, peek
from onegpu.config import Config, to_dict
from onegpu.models.protocol import LossFn
from onegpu.perf.contention import timed_cached
from onegpu.perf.devices import device_key, sync
from onegpu.techniques.bias_epilogue import inductor_options


def apply_compile(model: nn.Module, loss_fn: LossFn, mode: str, device: torch.device) -> LossFn:
    """Compile as `train.compile` says, for a run on `device` (the model may still be on the
    meta device); returns the loss function to call."""
    if mode == "none":
        return loss_fn
    if mode == "regional":
        for block in model.blocks:
            block.compile(options=inductor_options(device))
        return loss_fn
    if mode == "default":
        return torch.compile(loss_fn, options=inductor_options(device))
    # max-autotune: inductor's own GEMM templates may take the addmms the pass would route
    return torch.compile(loss_fn, mode=mode)


def undo_regional(model: nn.Module) -> None:
    """The blocks eager again (`nn.Module.compile` keeps its compiled call beside the module's
    own; dropping it restores the eager call)."""
    for block in model.blocks:
        block._compiled_call_impl = None


@dataclass(frozen=True, slots=True)
class Candidate:
    """A compile mode `auto` may time: `enter` applies it to the materialised model and
    returns the loss function to call; `leave` undoes what `enter` did to the model."""

    enter: Callable[[], LossFn]
    leave: Callable[[], None] = lambda: None


def auto_candidates(
    model: nn.Module, loss_fn: LossFn, wrap: Callable[[LossFn], LossFn], device: torch.device
) -> dict[str, Candidate]:
    """AUTO_MODES as candidates over the eager `loss_fn`; `wrap` goes around whatever is called
    (activation offload's hooks stay outermost). Each is compiled once and reused: the whole
    graph's wrapper, and the blocks' compiled calls (kept when the mode is left, put back when it
    is entered again, so a trial can switch between eager and compiled, and the run can take
    the trial's compile)."""
    whole: list[LossFn] = []

    def compiled_whole() -> LossFn:
        if not whole:
            options = inductor_options(device)
            whole.append(wrap(torch.compile(loss_fn, options=options)))
        return whole[0]

    compiled_blocks: list[Callable] = []

    def regional() -> LossFn:
        if compiled_blocks:  # entered again: the blocks' compiled calls back, none made anew
            for block, call in zip(model.blocks, compiled_blocks, strict=True):
                block._compiled_call_impl = call
        else:
            apply_compile(model, loss_fn, "regional", device)
        return wrap(loss_fn)

    def leave_regional() -> None:
        calls = [block._compiled_call_impl for block in model.blocks]
        if all(call is not None for call in calls):
            compiled_blocks[:] = calls
        undo_regional(model)

    return {
        "default": Candidate(compiled_whole),
        "regional": Candidate(regional, leave_regional),
    }


# ---------------------------------------------------------------------------- train.compile auto

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
TRIAL_METHOD = 5
"""How `time_compile` times (5: as 4, regional compile compiling the block once, not once a
block: 4's regional trials paid up to 8 compiles, techniques/bias_epilogue.py; 4: as 3, compiled
CPU linears adding their bias in oneDNN's epilogue; 3: eager and compiled side by side; 2 timed
eager on both sides of the compile, 1 before it only); part of the cache key, so trials timed
another way are made again rather than read."""
LEAST_COMPILE_S = {"cpu": 15.0, "cuda": 20.0}
"""The least a first compile is assumed to take before this machine has shown less."""


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
        valid=has("eager_step_s", "compiled_step_s", "compile_s"),
    )
    if ran:
        return dataclasses.replace(ran[0], mode=mode)
    return CompileTrial(
        found["eager_step_s"], found["compiled_step_s"], found["compile_s"], True, mode=mode
    )


def choose_compile(
    key: str,
    micro_steps: int,
    measures: dict[str, Callable[[], CompileTrial]],
) -> tuple[str, CompileTrial]:
    """The mode of `measures` that saves the most over the run's micro-batches (each mode's
    speedup over its own eager runs, applied to the fastest eager micro-batch any trial saw),
    or 'none' where none saves anything; each mode's trial cached under `key|mode` (run now if
    absent): deterministic given the cache and the run's length. Returns the best trial, the
    others beside it."""
    trials = [_trial(f"{key}|{mode}", mode, measure) for mode, measure in measures.items()]
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
        t
        for k, t in entries("compile.json").items()
        if k.startswith(here) and has("eager_step_s", "compiled_step_s", "compile_s")(t)
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
    """`train.compile auto` on the materialised model: eager or one of the `candidates`
    (AUTO_MODES), whichever the timing (cached per device, step fingerprint and mode) says
    saves the most over this run's micro-batches. Each candidate is left after its timing: the
    caller enters the chosen one. Without
    a cached timing, one eager micro-batch is timed first: where the run could not repay the
    least compile time this machine has shown even at the best speedup it has shown, compiled
    is never timed (no compile spent on a run that cannot win it back)."""
    key = f"{device_key(device)}|{step_fingerprint(cfg)}"
    micro_steps = cfg.train.max_steps * cfg.grad_accum_steps
    batch = trial_batch(cfg, model.vocab_size, device)
    valid = has("eager_step_s", "compiled_step_s", "compile_s")
    if any(peek("compile.json", f"{key}|{mode}", valid=valid) is None for mode in candidates):
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

    return choose_compile(key, micro_steps, {m: measure(c) for m, c in candidates.items()})


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
