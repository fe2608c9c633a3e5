"""What makes a configuration fit: `onegpu plan`'s fix list (and the out-of-memory report's).

Each candidate change is planned alone first; those that lower the peak are ordered by their
predicted step time (a change that costs nothing first: the chunked loss, 8-bit states; then
the ones that recompute or cross the host link) and applied one after another until the
configuration fits the device and the host. Searching plans many configurations, so the
candidates are planned from two shallow copies of the model (plan/depth.py) and the
configuration that fits is confirmed by following the full model once.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from onegpu.config import (
    Config,
    ConfigError,
    check_distributed,
    parse_checkpointing,
    resolve_strategy,
    to_toml,
    with_overrides,
)
from onegpu.offload.weights import with_offload_params
from onegpu.plan.budget import modelled_budget, plan_budget
from onegpu.plan.depth import plan_extrapolated
from onegpu.plan.memory import plan_memory
from onegpu.techniques.precision import DeviceCaps

# Candidate changes. On a CPU the device and the host are one memory: the host tiers save
# nothing there and are tried on GPU plans only.
FIXES: list[tuple[str, dict[str, str]]] = [
    ("chunked loss", {"memory.loss_chunk": "1024"}),
    # free where it applies (no clipping: refused, so skipped, elsewhere); with accumulation
    # it saves only the optimizer step's temporaries
    (
        "optimizer step in backward, no clipping",
        {"optim.in_backward": "true", "optim.grad_clip": "0"},
    ),
    ("8-bit AdamW", {"optim.name": "adamw8bit"}),
    ("4-bit AdamW", {"optim.name": "adamw4bit"}),
    ("selective checkpointing", {"memory.checkpointing": "selective"}),
    # a policy per block, the least recompute that fits the device (plan/budget.py)
    ("checkpointing by budget", {"memory.checkpointing": "budget:auto"}),
    # the states on the host, the step on the device: free where the link keeps up
    (
        "optimizer states in host memory",
        {"memory.offload_states": "true", "memory.offload_optimizer": "false"},
    ),
    ("bf16-pure weights", {"train.precision": "bf16-pure"}),
    # rank-1 moments, SGD's memory for AdamW-like steps; after bf16-pure, which it cannot
    # join (its updates would round away in bf16): it never displaces bf16-pure from a chain
    ("APOLLO-Mini", {"optim.name": "apollo-mini"}),
    ("activations in host memory", {"memory.offload_activations": "true"}),
    (
        "optimizer in host memory",
        {
            "memory.offload_optimizer": "true",
            "memory.offload_states": "false",
            "optim.in_backward": "false",
        },
    ),
    ("block checkpointing", {"memory.checkpointing": "block"}),
    (
        "weights in host memory",
        {
            "memory.offload_params": "true",
            "memory.offload_states": "false",
            "optim.in_backward": "false",
        },
    ),
    ("half the micro-batch (accumulate)", {"train.micro_batch_size": "/2"}),
]
HOST_TIERS = {
    "activations in host memory",
    "optimizer states in host memory",
    "optimizer in host memory",
    "weights in host memory",
}


def resolved(cfg: Config, change: dict[str, str]) -> dict[str, str]:
    """A fix's overrides for `cfg` ('/2': its micro-batch halved)."""
    return {
        k: str(max(1, cfg.train.micro_batch_size // int(v[1:]))) if v.startswith("/") else v
        for k, v in change.items()
    }


def value_of(cfg: Config, key: str) -> str:
    """`cfg`'s value of `section.field` as an override writes it."""
    section, name = key.split(".")
    current = getattr(getattr(cfg, section), name)
    return str(current).lower() if isinstance(current, bool) else str(current)


def differs(cfg: Config, key: str, value: str) -> bool:
    return value_of(cfg, key) != value


def with_fix(cfg: Config, change: dict[str, str]) -> Config:
    """cfg with a fix applied; refused (ConfigError) if the result is invalid."""
    return with_overrides(cfg, resolved(cfg, change))


@dataclass(frozen=True)
class Planned:
    """One configuration as a single process on the target: device peak (tensors only, the
    CUDA context not included), host bytes, predicted step time (None: no known peak)."""

    peak: int
    host: int
    step_s: float | None
    n_params: int = 0
    flops_per_token: int = 0
    ops_per_micro_batch: float = 0.0  # the step's launched ops over its micro-batches


def planned(
    cfg: Config,
    target: str,
    caps: DeviceCaps | None,
    gpu: str | None,
    *,
    fast: bool,
    speed: bool = True,
    capacity: int | None = None,
) -> Planned:
    """Plan `cfg` as `onegpu plan` does for one process (weights on the host included); `fast`:
    from two shallow copies of the model. `budget:auto` checkpointing takes `capacity`
    (decided in full, or `fast` as the knapsack models it)."""
    from onegpu.plan.targets import predicted_speed, process_share, rank_memory

    cfg = with_offload_params(cfg)
    if parse_checkpointing(cfg.memory.checkpointing).kind == "budget":
        if fast:
            mixed, peak, plain = modelled_budget(cfg, target, caps, capacity)
            step = predicted_speed(mixed, plain, gpu, 1) if speed else {}
            host = plain.memory.get("host", 0)
            return Planned(
                peak, host, step.get("predicted_step_time_s"), plain.n_params, plain.flops_per_token
            )
        cfg, _ = plan_budget(cfg, target, caps, capacity)
    strategy = resolve_strategy(cfg.dist, 1)
    check_distributed(cfg, strategy, 1)
    share = process_share(cfg, 1)
    if fast:
        plan = plan_extrapolated(share, target, caps)
    else:
        plan = plan_memory(share, target, caps, by_segment=strategy != "none")
    mem = rank_memory(cfg.dist, plan, 1, strategy) if strategy != "none" else plan.memory
    # the speed needs this CPU's measured peaks (seconds, once per machine): only when asked
    # (`auto` precision on a CPU with native bf16 weighed them already, in the build)
    step_s = predicted_speed(cfg, plan, gpu, 1).get("predicted_step_time_s") if speed else None
    ops = plan.dispatched_ops / cfg.grad_accum_steps
    return Planned(
        mem["peak"], mem.get("host", 0), step_s, plan.n_params, plan.flops_per_token, ops
    )


def fixes_for(
    cfg: Config,
    budget: int,
    target: str,
    caps: DeviceCaps | None = None,
    *,
    base_peak: int | None = None,
    gpu: str | None = None,
    host_budget: int | None = None,
    fast: bool = True,
) -> list[dict[str, Any]]:
    """The changes, fastest first, that bring the device peak under `budget` (and the host's
    bytes under `host_budget`). A change is applied only where it lowers the peak so far
    (starting from `base_peak`, the configuration's own): e.g. not the chunked loss at a huge
    vocabulary and micro-batch 1, where its fp32 weight gradient buffer outweighs the logits it
    saves. The entry that fits carries the whole configuration (`best_toml`,
    `best_overrides`)."""
    search = _Search(target, caps, gpu, budget, host_budget or 2**62, fast)
    alone = search.alone(cfg)
    found = search.chain(cfg, base_peak, alone)
    search.drop_unneeded(cfg, found)
    return search.single_instead(cfg, alone, found)


@dataclass
class _Search:
    target: str
    caps: DeviceCaps | None
    gpu: str | None
    budget: int
    host_budget: int
    fast: bool

    def plan(self, cfg: Config, *, full: bool = False) -> Planned:
        fast = self.fast and not full
        return planned(cfg, self.target, self.caps, self.gpu, fast=fast, capacity=self.budget)

    def fits(self, p: Planned) -> bool:
        return p.peak <= self.budget and p.host <= self.host_budget

    def confirmed(self, cfg: Config, p: Planned) -> Planned:
        """`p` if it does not fit or was planned in full; else the full model's plan."""
        return self.plan(cfg, full=True) if self.fits(p) and self.fast else p

    def alone(self, cfg: Config) -> list[tuple[str, dict, Planned]]:
        """Each fix that applies, planned by itself, fastest first; within 1% of the same
        predicted time in the list's order of usual cost (the prediction counts FLOPs and
        bytes: a smaller micro-batch costs more than it shows). One that saves nothing alone
        stays a candidate: it may save once another has moved the peak (the optimizer step
        in backward, once the activations no longer set it)."""
        out = []
        for name, change in FIXES:
            if self.target == "cpu" and name in HOST_TIERS:
                continue
            try:
                p = self.plan(with_fix(cfg, change))
            except ConfigError:
                continue
            out.append((name, change, p))
        order = {name: i for i, (name, _) in enumerate(FIXES)}
        out.sort(key=lambda a: (round(math.log(a[2].step_s or 1.0) / math.log(1.01)), order[a[0]]))
        return out

    def chain(self, cfg: Config, base_peak: int | None, alone: list) -> list[dict[str, Any]]:
        """The fastest change that lowers the peak of the configuration so far (planned on
        top of it), again and again until it fits: a change that saved nothing earlier may
        save once another has moved the peak (block checkpointing after the optimizer states
        left the device), and one that is fast alone may be slow on top of the others (the
        optimizer on the host after its states were quantized)."""
        found: list[dict[str, Any]] = []
        current, current_peak, applied = cfg, base_peak, {}
        remaining = list(alone)
        while remaining and not (found and found[-1]["fits_with_previous"]):
            best = self._fastest_lowering(current, current_peak, remaining)
            if best is None:
                break  # nothing left lowers the peak
            i, candidate, together = best
            name, change, p = remaining.pop(i)
            together = self.confirmed(candidate, together)
            fits = self.fits(together)
            applied.update(
                {k: v for k, v in resolved(current, change).items() if differs(current, k, v)}
            )
            current, current_peak = candidate, together.peak
            found.append(self.entry(name, change, p, together, fits, found))
            if fits:
                found[-1].update(best_toml=to_toml(current), best_overrides=dict(applied))
        return found

    def _fastest_lowering(
        self, current: Config, current_peak: int | None, remaining: list
    ) -> tuple[int, Config, Planned] | None:
        """(index in `remaining`, the configuration, its plan) of the fastest change that
        lowers `current_peak`, within 1% in the list's order; None if none does."""
        best, best_key = None, None
        for i, (_, change, _) in enumerate(remaining):
            try:
                candidate = with_fix(current, change)
                together = self.plan(candidate)
            except ConfigError:
                continue
            if current_peak is not None and together.peak >= current_peak:
                continue  # nothing more saved on top of the ones above (or it undoes one)
            if together.host > self.host_budget:
                continue  # beyond the host: a leaner change first may bring it within
            key = round(math.log(together.step_s or 1.0) / math.log(1.01))
            if best_key is None or key < best_key:
                best, best_key = (i, candidate, together), key
        return best

    def drop_unneeded(self, cfg: Config, found: list[dict[str, Any]]) -> None:
        """Once the chain fits, each change before the last that the others fit without, at
        no more than 1% of predicted time, is dropped (marked `dropped`), newest first: a
        change that helped on the way (activations on the host before block checkpointing
        made them few; 4-bit states where 8-bit ones fit once they left the device) is not
        worth its risk at the end. `best_toml` is the configuration without them."""
        if not (found and found[-1]["fits_with_previous"]):
            return
        kept = list(range(len(found)))
        step_s = found[-1]["step_s_with_previous"]
        for i in reversed(range(len(found) - 1)):
            trial = [j for j in kept if j != i]
            try:
                candidate, overrides = _applied(cfg, [found[j]["overrides"] for j in trial])
                p = self.confirmed(candidate, self.plan(candidate))
            except ConfigError:
                continue
            if self.fits(p) and p.step_s is not None and p.step_s <= 1.01 * (step_s or 0):
                kept = trial
                found[i]["dropped"] = True
                found[-1].update(
                    best_toml=to_toml(candidate),
                    best_overrides=overrides,
                    peak_with_previous=p.peak,
                    host_with_previous=p.host,
                    step_s_with_previous=p.step_s,
                )

    def single_instead(self, cfg: Config, alone: list, found: list) -> list[dict[str, Any]]:
        """One change that fits by itself can beat the chain (the host tiers are alternatives,
        not steps: weights on the host take the optimizer with them): the fastest such one is
        offered where the chain does not fit, or is predicted slower."""
        fitted = found and found[-1]["fits_with_previous"]
        chain_s = found[-1]["step_s_with_previous"] if fitted else None
        for name, change, p in alone:
            if not self.fits(p):
                continue
            if chain_s is not None and (p.step_s is None or p.step_s >= chain_s):
                break  # sorted by step time: none after this one is faster either
            candidate = with_fix(cfg, change)
            confirmed = self.confirmed(candidate, p)
            if self.fits(confirmed):
                for f in found:
                    f.pop("best_toml", None)
                    f.pop("best_overrides", None)
                found.append(self.entry(name, change, p, confirmed, True, []))
                found[-1].update(
                    instead=True,
                    best_toml=to_toml(candidate),
                    best_overrides={
                        k: v for k, v in resolved(cfg, change).items() if differs(cfg, k, v)
                    },
                )
                break
        return found

    def entry(
        self,
        name,
        change,
        alone: Planned,
        together: Planned,
        fits: bool,
        previous: list[dict[str, Any]],
    ) -> dict[str, Any]:
        return {
            "change": name,
            "overrides": change,
            "peak_alone": alone.peak,
            "fits_alone": self.fits(alone),
            "step_s_alone": alone.step_s,
            "peak_with_previous": together.peak,
            "host_with_previous": together.host,
            "step_s_with_previous": together.step_s,
            "fits_with_previous": fits,
            "cumulative": [f["change"] for f in previous] + [name],
        }


def _applied(cfg: Config, changes: list[dict[str, str]]) -> tuple[Config, dict[str, str]]:
    """`cfg` with `changes` applied in order, and the overrides by which the result differs
    from `cfg` (a key a later change set back is not among them)."""
    current, touched = cfg, []
    for change in changes:
        touched += resolved(current, change)
        current = with_fix(current, change)
    overrides = {k: value_of(current, k) for k in dict.fromkeys(touched)}
    return current, {k: v for k, v in overrides.items() if differs(cfg, k, v)}
