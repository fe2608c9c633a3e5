"""Checkpointing by budget: `memory.checkpointing budget:BYTES` picks, per block, what to save
and what to recompute so that the step's planned peak fits BYTES at the least recomputation.

Rotor (Beaumont et al., "Optimal checkpointing for heterogeneous chains: how to train deep
neural networks with limited memory", 2019) finds the fastest schedule for a memory budget by
dynamic programming over each stage's saved bytes and recompute time. Here the stages are the
blocks and the choices per block are onegpu's policies (none, selective, attn, mlp, attn+mlp,
block):

1. The planner follows the step once per uniform policy: each block's saved bytes under each
   policy (`saved_by_block`) and the peak of each.
2. The peak of a mix is modelled as what the step holds besides the blocks' saved activations,
   plus each block's weight under its policy: its saved bytes and an even share of what that
   policy's peak holds beyond them (the block being recomputed, selective's cached outputs),
   so that the model gives each uniform policy's planned peak exactly. A recompute costs the
   share of a block's forward its policy redoes (perf/flops.py's RECOMPUTE).
3. A multiple-choice knapsack (numpy) gives the least recompute whose modelled peak fits (or
   a uniform policy that fits, where that recomputes less); the planner then follows the
   chosen mix in full. Where the model was optimistic the knapsack
   runs again with the budget lowered by the overshoot, so what is returned was planned within
   the budget.

The result is written as `blocks:P,P,...` (the run folder's config.toml records it), and a
budget below the leanest policy's planned peak is refused with that minimum.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from onegpu.config import (
    BLOCK_POLICIES,
    Config,
    ConfigError,
    parse_checkpointing,
    per_block_mode,
    to_toml,
    with_overrides,
)
from onegpu.perf.flops import RECOMPUTE
from onegpu.plan.depth import plan_extrapolated
from onegpu.plan.memory import MemoryPlan, plan_memory
from onegpu.techniques.precision import DeviceCaps

STEPS = 4000
"""Resolution of the knapsack's byte axis: the budget in this many steps."""
TRIES = 4
"""Knapsacks run before the leanest uniform policy that fits is taken instead."""


@dataclass(frozen=True)
class BlockCosts:
    """Per policy: each block's saved bytes, and the step's planned peak under it."""

    saved: dict[str, list[int]]
    peaks: dict[str, int]
    plain: MemoryPlan
    """The step planned with no checkpointing (its parameters, FLOPs and host bytes)."""

    @property
    def n_blocks(self) -> int:
        return len(self.saved["none"])

    def rest(self) -> int:
        """What the step holds at its peak besides the blocks' saved activations (from the
        plain step, whose peak holds them all)."""
        return self.peaks["none"] - sum(self.saved["none"])

    def weight(self, policy: str, block: int) -> int:
        """What `block` under `policy` adds to the peak: its saved bytes, and an even share of
        what the policy's planned peak holds beyond the saved bytes and the rest (a recomputed
        block's rebuilt activations, selective's cached outputs). Summed over the blocks of a
        uniform policy, it is that policy's planned peak less the rest: the model is exact
        where the planner has measured it."""
        beyond = self.peaks[policy] - self.rest() - sum(self.saved[policy])
        return max(0, self.saved[policy][block] + beyond // self.n_blocks)


_COSTS: dict[tuple[str, str, str], BlockCosts] = {}
"""block_costs per configuration (less its checkpointing), target and capabilities: a search
asks again for the same step (the fix list: alone, in its chain, then in full)."""


def block_costs(cfg: Config, target: str, caps: DeviceCaps | None) -> BlockCosts:
    """Each uniform policy planned (two shallow copies each where the model is deep); the
    policies the model or the configuration cannot take (no attn module, selective under
    compile) are left out."""
    key = (to_toml(with_overrides(cfg, {"memory.checkpointing": "none"})), target, repr(caps))
    if key not in _COSTS:
        _COSTS[key] = _block_costs(cfg, target, caps)
    return _COSTS[key]


def _block_costs(cfg: Config, target: str, caps: DeviceCaps | None) -> BlockCosts:
    saved: dict[str, list[int]] = {}
    peaks: dict[str, int] = {}
    plans: dict[str, MemoryPlan] = {}
    for policy in BLOCK_POLICIES:
        try:
            plan = plan_extrapolated(
                with_overrides(cfg, {"memory.checkpointing": policy}), target, caps
            )
        except ConfigError:
            if policy == "none":
                raise
            continue
        # every block, also one that saves nothing on the device (its activations offloaded)
        n = len(plan.block_numels)
        saved[policy] = [plan.saved_by_block.get(f"blocks.{i}", 0) for i in range(n)]
        peaks[policy] = plan.memory["peak"]
        plans[policy] = plan
    return BlockCosts(saved, peaks, plans["none"])


def cheapest_mix(costs: BlockCosts, budget: int) -> list[str] | None:
    """The per-block policies of least total recompute whose modelled peak (the rest plus each
    block's weight) is within `budget`; None where none is. The knapsack's mix, or a uniform
    policy planned within the budget where that recomputes less (at a budget equal to a
    uniform policy's peak, the knapsack's rounding up can miss it by a step)."""
    options = [[p] * costs.n_blocks for p in costs.saved if costs.peaks[p] <= budget]
    room = budget - costs.rest()
    mix = _knapsack(costs, list(costs.saved), room) if room >= 0 else None
    options = ([mix] if mix else []) + options
    if not options:
        return None
    return min(options, key=lambda choice: sum(RECOMPUTE[p] for p in choice))


def _knapsack(costs: BlockCosts, policies: list[str], room: int) -> list[str] | None:
    """A multiple-choice knapsack over the bytes: the least total recompute with the blocks'
    weights within `room`, each weight rounded up to the axis' steps so that a choice never
    holds more than it counts."""
    unit = max(1, math.ceil(room / STEPS))
    cap = room // unit
    best = np.full(cap + 1, np.inf)
    best[0] = 0.0  # best[w]: least recompute with the blocks so far holding w units
    picks = np.zeros((costs.n_blocks, cap + 1), dtype=np.int8)
    for i in range(costs.n_blocks):
        nxt = np.full(cap + 1, np.inf)
        for k, p in enumerate(policies):
            w = math.ceil(costs.weight(p, i) / unit)
            if w > cap:
                continue
            moved = np.full(cap + 1, np.inf)
            moved[w:] = best[: cap + 1 - w] + (RECOMPUTE[p] - 1.0)
            better = moved < nxt
            nxt[better], picks[i][better] = moved[better], k
        best = nxt
    if not np.isfinite(best).any():
        return None
    w = int(np.argmin(best))  # the least recompute, and of equals the fewest bytes
    choice = []
    for i in reversed(range(costs.n_blocks)):
        p = policies[picks[i][w]]
        choice.append(p)
        w -= math.ceil(costs.weight(p, i) / unit)
    return choice[::-1]


def modelled_budget(
    cfg: Config, target: str, caps: DeviceCaps | None, capacity: int | None
) -> tuple[Config, int, MemoryPlan]:
    """A search's quick look at `budget:` (the fix list plans many candidates): the knapsack's
    mix without following it in full, its modelled peak, and the plain step's plan. ConfigError
    where no mix is modelled to fit."""
    budget = parse_checkpointing(cfg.memory.checkpointing).budget or capacity
    if budget is None:
        raise ConfigError("memory.checkpointing", "budget:auto needs a device budget here")
    costs = block_costs(cfg, target, caps)
    chosen = cheapest_mix(costs, budget)
    if chosen is None:
        raise ConfigError("memory.checkpointing", f"no per-block plan fits budget:{budget}")
    peak = costs.rest() + sum(costs.weight(p, i) for i, p in enumerate(chosen))
    return _with(cfg, chosen), peak, costs.plain


def plan_budget(
    cfg: Config, target: str, caps: DeviceCaps | None, capacity: int | None
) -> tuple[Config, dict[str, Any]]:
    """`cfg` with its `budget:` checkpointing replaced by the per-block plan it resolves to,
    and what was decided. `capacity`: the device's bytes, which `budget:auto` takes."""
    mode = parse_checkpointing(cfg.memory.checkpointing)
    budget = mode.budget or capacity
    if budget is None:
        raise ConfigError(
            "memory.checkpointing",
            "budget:auto takes the device's memory, and none is given here: name the bytes "
            "(budget:8000000000), or plan for a device (--gpu NAME or --memory BYTES)",
        )
    costs = block_costs(cfg, target, caps)
    floor = min(costs.peaks.values())
    if budget < floor:
        leanest = min(costs.peaks, key=costs.peaks.__getitem__)
        raise ConfigError(
            "memory.checkpointing",
            f"budget:{budget} is below what this step needs whatever it recomputes: at least "
            f"{floor:,} bytes ({floor / 2**30:.2f} GiB, every block '{leanest}'); raise the "
            "budget, or lower the micro-batch or the precision",
        )
    chosen, plan = _fitted(cfg, costs, budget, target, caps)
    recompute = 1.0 + sum(RECOMPUTE[p] - 1.0 for p in chosen) / len(chosen)
    decided = {
        "budget": budget,
        "checkpointing": per_block_mode(chosen),
        "planned_peak": plan.memory["peak"],
        "recompute_factor": recompute,
        "uniform_peaks": costs.peaks,
    }
    resolved = dataclasses.replace(
        cfg, memory=dataclasses.replace(cfg.memory, checkpointing=decided["checkpointing"])
    )
    return resolved, decided


def _fitted(
    cfg: Config, costs: BlockCosts, budget: int, target: str, caps: DeviceCaps | None
) -> tuple[list[str], MemoryPlan]:
    """The cheapest mix whose full plan fits `budget`: the knapsack's, its budget lowered by
    each overshoot (the uniform plans are extrapolated from shallow copies, the mix is planned
    in full); else the uniform policy of least recompute that fits."""
    room = budget
    for _ in range(TRIES):
        chosen = cheapest_mix(costs, room)
        if chosen is None:
            break
        plan = plan_memory(_with(cfg, chosen), target, caps)
        if plan.memory["peak"] <= budget:
            return chosen, plan
        # lower by the overshoot, and by what the knapsack's rounding could hide, so that the
        # next mix is another one
        room -= plan.memory["peak"] - budget + costs.n_blocks * math.ceil(room / STEPS)
    fitting = [p for p in costs.peaks if costs.peaks[p] <= budget]
    for policy in sorted(fitting, key=lambda p: RECOMPUTE[p]):
        chosen = [policy] * costs.n_blocks
        plan = plan_memory(_with(cfg, chosen), target, caps)
        if plan.memory["peak"] <= budget:
            return chosen, plan
    raise ConfigError(
        "memory.checkpointing",
        f"no per-block plan was planned within budget:{budget} (the leanest policy's peak "
        f"is {min(costs.peaks.values()):,} bytes when extrapolated, more in full); raise it",
    )


def _with(cfg: Config, chosen: list[str]) -> Config:
    return with_overrides(cfg, {"memory.checkpointing": per_block_mode(chosen)})
