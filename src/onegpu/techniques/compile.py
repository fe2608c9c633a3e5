"""torch.compile, whole or regional, applied after every module change (backends/torch/model.py's order).

- 'default' / 'max-autotune': the loss function (forward, output layer and cross-entropy) is
  compiled as one graph, so inductor can fuse the loss with the logits it consumes.
- 'regional': each transformer block is compiled in place (`nn.Module.compile`). The blocks run
  the same code on same-shaped inputs, so dynamo compiles the first one and reuses the result
  for the others: compile time does not grow with depth (what `nn.scan` over layers does in JAX,
  as Lippe's "Profiling and Scaling Single-GPU Transformer Models" shows). Embeddings, final
  norm and loss stay eager.

Compilation is lazy: nothing is compiled until the first step runs.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from onegpu.cache import cached, entries, has, peek
from onegpu.config import Config, to_dict
from onegpu.models.protocol import LossFn
from onegpu.perf.devices import device_key, sync


def apply_compile(model: nn.Module, loss_fn: LossFn, mode: str) -> LossFn:
    """Compile as `train.compile` says; returns the loss function to call."""
    if mode == "none":
        return loss_fn
    if mode == "regional":
        for block in model.blocks:
            block.compile()
        return loss_fn
    return torch.compile(loss_fn, mode=None if mode == "default" else mode)


# ---------------------------------------------------------------------------- train.compile auto

MIN_STEPS = 100
"""Shorter runs never time compile for `auto`: on a CPU it costs 20-60 s, which a short run does
not win back (docs/auto-defaults.md)."""


BEST_SPEEDUP = {"cpu": 1.15, "cuda": 1.6}
"""The most a compiled micro-batch is assumed faster than eager (eager / compiled) before this
machine has shown more: the bound that decides whether a trial is worth running at all. CPU:
the best inductor gave on our GPT on the EPYCs of docs/cpu-notes.md was below this (often
slower than eager); CUDA: above what compile gives a fused-attention GPT step."""
LEAST_COMPILE_S = {"cpu": 15.0, "cuda": 20.0}
"""The least a first compile is assumed to take before this machine has shown less."""


@dataclass(frozen=True, slots=True)
class CompileTrial:
    """One micro-batch's forward + backward, eager and compiled ('default'), and what compiling
    cost; measured once per device, model and settings, then read from the cache. `skipped`:
    why compiled was never timed (the run could not repay any compile), else ''."""

    eager_s: float
    compiled_s: float
    compile_s: float
    cached: bool = False
    skipped: str = ""

    def pays(self, micro_steps: int) -> bool:
        """Whether compiling saves more over `micro_steps` micro-batches than it costs."""
        return (self.eager_s - self.compiled_s) * micro_steps > self.compile_s

    def as_dict(self) -> dict[str, Any]:
        d = {
            "eager_step_s": self.eager_s,
            "compiled_step_s": self.compiled_s,
            "compile_s": self.compile_s,
            "cached": self.cached,
        }
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


def time_compile(
    model: nn.Module,
    eager: LossFn,
    compiled: LossFn,
    batch: tuple[torch.Tensor, torch.Tensor],
    autocast: Callable[[], contextlib.AbstractContextManager],
    device: torch.device,
) -> CompileTrial:
    """Run `batch` through both loss functions on the real model (gradients dropped after each
    run, RNG state restored): each one's minimum over 2 runs after a first one (the eager warm-up;
    the compiled compile, whose excess is the compile time)."""
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        _timed(eager, model, batch, autocast, device)
        eager_s = min(_timed(eager, model, batch, autocast, device) for _ in range(2))
        first = _timed(compiled, model, batch, autocast, device)
        compiled_s = min(_timed(compiled, model, batch, autocast, device) for _ in range(2))
    return CompileTrial(eager_s, compiled_s, max(0.0, first - compiled_s))


def choose_compile(
    key: str,
    micro_steps: int,
    measure: Callable[[], CompileTrial],
) -> tuple[str, CompileTrial]:
    """'default' or 'none' for `auto`, from the trial cached under `key` (run now if absent):
    deterministic given the cache and the run's length."""
    ran: list[CompileTrial] = []

    def run() -> dict[str, float]:
        ran.append(measure())
        return {k: v for k, v in ran[0].as_dict().items() if k != "cached"}

    found = cached(
        "compile.json", key, run, valid=has("eager_step_s", "compiled_step_s", "compile_s")
    )
    trial = (
        ran[0]
        if ran
        else CompileTrial(
            found["eager_step_s"], found["compiled_step_s"], found["compile_s"], cached=True
        )
    )
    return ("default" if trial.pays(micro_steps) else "none"), trial


def auto_candidate(cfg: Config, device: torch.device, distributed: bool) -> str:
    """`train.compile` as set, or for 'auto' the mode to time against eager: 'default' on a
    single-process CPU or CUDA run of at least MIN_STEPS steps without selective checkpointing,
    else 'none' (nothing to time)."""
    if cfg.train.compile != "auto":
        return cfg.train.compile
    if cfg.memory.checkpointing == "selective":
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
    compiled: LossFn,
    autocast: Callable[[], contextlib.AbstractContextManager],
    device: torch.device,
) -> tuple[str, CompileTrial]:
    """`train.compile auto` on the materialised model: eager or compiled, whichever the timing
    (cached per device and step fingerprint) says pays over this run's micro-batches. Without
    a cached timing, one eager micro-batch is timed first: where the run could not repay the
    least compile time this machine has shown even at the best speedup it has shown, compiled
    is never timed (no compile spent on a run that cannot win it back)."""
    key = f"{device_key(device)}|{step_fingerprint(cfg)}"
    micro_steps = cfg.train.max_steps * cfg.grad_accum_steps
    batch = trial_batch(cfg, model.vocab_size, device)
    if peek("compile.json", key, valid=has("eager_step_s", "compiled_step_s", "compile_s")) is None:
        eager_s = _eager_s(model, eager, batch, autocast, device)
        saves, costs = repay_bound(device, eager_s, micro_steps)
        if saves <= costs:
            why = (
                f"{micro_steps} micro-batches of {eager_s * 1e3:,.0f} ms could save at most "
                f"{saves:,.0f} s against at least {costs:,.0f} s of compiling"
            )
            return "none", CompileTrial(eager_s, float("nan"), float("nan"), skipped=why)
    return choose_compile(
        key,
        micro_steps,
        lambda: time_compile(model, eager, compiled, batch, autocast, device),
    )


def step_fingerprint(cfg: Config) -> str:
    """What a micro-batch's forward and backward depend on, as a short stable key."""
    d = to_dict(cfg)
    what = {
        "model": d["model"],
        "memory": d["memory"],
        "precision": cfg.train.precision,
        "batch": [cfg.train.micro_batch_size, cfg.train_seq_len],
    }
    return hashlib.sha256(json.dumps(what, sort_keys=True).encode()).hexdigest()[:16]


def trial_batch(cfg: Config, out_vocab: int, device: torch.device):
    """A micro-batch of random tokens of the run's shape (targets below `out_vocab`, the
    model's output size)."""
    g = torch.Generator().manual_seed(0)
    shape = (cfg.train.micro_batch_size, cfg.train_seq_len)
    x = torch.randint(0, cfg.model.vocab_size, shape, generator=g)
    y = torch.randint(0, out_vocab, shape, generator=g)
    return x.to(device), y.to(device)
