"""`onegpu tune --gpu NAME` where that GPU is not here: the search by prediction alone.

Nothing can be measured for a GPU that is not in the machine (an 8B model does not run on a
laptop CPU), so the candidates are ranked by the planner's predicted step time, as `onegpu
plan` prices it (FLOPs at the GPU's datasheet peak, recomputation, host-link transfers, the
CPU's optimizer step), and the winner is written as best.toml like a measured search's.

The search is branch and bound, in three steps, so an 8B model on a named GPU takes minutes:

1. Arithmetic, no planning: a candidate whose weights, gradients and optimizer states alone
   (those it keeps on the device) exceed the GPU, or whose host-side bytes exceed the host
   memory, is pruned. So is one with a lower bound on its step time (compute with its
   recomputation, its host step, its link bytes) no better than a candidate already planned.
2. The survivors are planned fastest-bound first from two shallow copies of the model
   (plan/depth.py), largest micro-batch first per setting of the rest.
3. The fastest that fits is confirmed by following the full model (the next one if not).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from onegpu.config import Config, ConfigError, to_toml, with_overrides
from onegpu.offload.pricing import LINK_EFFICIENCY, exposed_host_step
from onegpu.optim.host_step import host_step_rate
from onegpu.optim.state_bytes import state_bytes_per_param
from onegpu.perf.devices import GPUS
from onegpu.perf.flops import recompute_factor
from onegpu.perf.host_memory import machine_ram
from onegpu.plan.fixes import Planned, planned
from onegpu.plan.targets import EAGER_COMPILES, EFFICIENCY, HOST_SECONDS_PER_OP, gpu_caps
from onegpu.runs.atomic import write_together
from onegpu.techniques.precision import resolve_precision


@dataclass
class Bound:
    """What arithmetic alone says of a candidate (no planning)."""

    device: int  # bytes it must keep on the device at least
    host: int  # bytes it must keep on the host at least
    step_s: float  # seconds a step takes at least


LEAST_OPS_SHARE = 0.4
"""A candidate launches at least this share of the plain configuration's ops a micro-batch:
fp32 drops autocast's casts, no chunked loss drops the chunks' ops (together about 0.6 of
bf16's at A's shape); checkpointing only adds. A floor for the search's bound, not a plan."""


def bound(
    cfg: Config,
    n_params: int,
    flops_per_token: int,
    gpu: str,
    saved_blocks: int,
    ops_per_micro_batch: float = 0.0,
) -> Bound:
    """Lower bounds of a candidate's device bytes, host bytes and step time. On the device at
    least: the weights and states it keeps there, and beside them either the blocks' saved
    activations (at the end of a forward: `saved_blocks` per sequence, planned) or
    its gradients (at the optimizer step)."""
    m, o = cfg.memory, cfg.optim
    spec = GPUS[gpu]
    precision = resolve_precision(cfg.train.precision, gpu_caps(gpu)).name
    host_weights = torch.bfloat16 if precision == "bf16-pure" else torch.float32
    weight = host_weights.itemsize
    # bf16 with the optimizer on the host: the matmul weights are bf16 on the device (at
    # least: embeddings and norms stay fp32), fp32 masters on the host
    on_device = 2 if precision == "bf16" and m.offload_optimizer else weight
    states = state_bytes_per_param(o.name) * n_params
    host_states = m.offload_optimizer or m.offload_params
    weights = 0 if m.offload_params else on_device * n_params
    stepped_in_backward = o.in_backward and cfg.grad_accum_steps == 1  # else they accumulate
    grads = 0 if host_states or stepped_in_backward else weight * n_params
    activations = 0 if m.offload_activations else saved_blocks * cfg.train.micro_batch_size
    states_away = host_states or m.offload_states  # memory.offload_states: host, stepped here
    device = weights + (0 if states_away else states) + max(activations, grads)
    host = (weight * n_params + states) if host_states else states if m.offload_states else 0
    peak = spec.peak.get({"bf16-pure": "bf16"}.get(precision, precision), spec.peak["fp32"])
    tokens = cfg.train.batch_size * cfg.train_seq_len
    compute = flops_per_token * recompute_factor(m.checkpointing) * tokens / (peak * EFFICIENCY)
    link = 0.0
    if host_states:  # the gradients out once per micro-batch, weights back once a step
        link = (
            (cfg.grad_accum_steps + 1) * on_device * n_params / (spec.host_link * LINK_EFFICIENCY)
        )
    if m.offload_states:  # the states to the device for their step and back
        link = 2 * states / (spec.host_link * LINK_EFFICIENCY)
    host_step = n_params / host_step_rate(o.name, host_weights)[0] if host_states else 0.0
    if cfg.train.compile in EAGER_COMPILES:  # the host's launches, at their least
        launches = LEAST_OPS_SHARE * ops_per_micro_batch * cfg.grad_accum_steps
        compute = max(compute, launches * HOST_SECONDS_PER_OP)
    host_step = exposed_host_step(cfg, host_step, compute, 1)
    return Bound(int(device), int(host), max(compute, link) + host_step)


def activation_floors(cfg: Config, gpu: str, cands: list[dict[str, str]]) -> dict[tuple, int]:
    """(checkpointing, precision) -> saved activations of one sequence that grow with the
    micro-batch, planned (two shallow copies each: a few plans in all)."""
    from onegpu.plan.depth import saved_per_sequence

    keys = {(_floor_policy(c["memory.checkpointing"]), c["train.precision"]) for c in cands}
    return {
        key: saved_per_sequence(
            with_overrides(cfg, {"memory.checkpointing": key[0], "train.precision": key[1]}),
            "cuda",
            gpu_caps(gpu),
        )
        for key in keys
    }


def _floor_policy(checkpointing: str) -> str:
    """The uniform policy whose saved activations bound a candidate's from below: a budget's
    mix saves at least what `block` saves everywhere."""
    return "block" if checkpointing.startswith("budget:") else checkpointing


def _by_bound(
    cfg: Config,
    cands: list[dict[str, str]],
    base: Planned,
    floors: dict[tuple[str, str], int],
    gpu: str,
    budget: int,
    host_budget: int,
) -> list[tuple[float, int, dict[str, str], Config]]:
    """The candidates whose arithmetic lower bound fits, fastest bound first (then the
    largest micro-batch)."""
    scored = []
    for change in cands:
        c = with_overrides(cfg, change)
        saved = floors[(_floor_policy(change["memory.checkpointing"]), change["train.precision"])]
        b = bound(c, base.n_params, base.flops_per_token, gpu, saved, base.ops_per_micro_batch)
        if b.device <= budget and b.host <= host_budget:
            scored.append((b.step_s, -c.train.micro_batch_size, change, c))
    return sorted(scored, key=lambda s: (s[0], s[1]))


def search(
    cfg: Config,
    cands: list[dict[str, str]],
    gpu: str,
    budget: int,
    host_budget: int,
    log: Callable[[str], None] = print,
) -> dict[str, Any]:
    """Candidates ranked by predicted step time; the fastest that fits confirmed in full."""
    t0 = time.perf_counter()
    target, caps = "cuda", gpu_caps(gpu)
    base = planned(cfg, target, caps, gpu, fast=True)
    floors = activation_floors(cfg, gpu, cands)
    log(f"  {len(floors)} activation floors planned in {time.perf_counter() - t0:.0f} s")
    scored = _by_bound(cfg, cands, base, floors, gpu, budget, host_budget)
    pruned = len(cands) - len(scored)
    log(
        f"tune (predicted for {gpu}): {len(cands)} candidates, {pruned} pruned by arithmetic "
        f"(what they must keep exceeds {budget / 2**30:.1f} GiB on the device "
        f"or {host_budget / 2**30:.1f} GiB on the host), {len(scored)} to plan, fastest bound first"
    )
    rows: list[dict[str, Any]] = []
    best: dict[str, Any] | None = None
    for i, (lower, _, change, c) in enumerate(scored):
        if best is not None and lower >= best["step_s"]:
            log(
                f"  stopped after {i} planned: no candidate left can beat "
                f"{best['step_s'] * 1e3:,.0f} ms/step"
            )
            break
        try:
            p = planned(c, target, caps, gpu, fast=True, capacity=budget)
        except ConfigError:
            continue
        fits = p.peak <= budget and p.host <= host_budget
        row = _row(change, p, fits, c)
        rows.append(row)
        if fits and (best is None or (p.step_s or 0) < best["step_s"]):
            full = planned(c, target, caps, gpu, fast=False, capacity=budget)
            if full.peak <= budget and full.host <= host_budget:
                best = _row(change, full, True, c)
                rows[-1] = best
        if (i + 1) % 10 == 0:
            so_far = f", best so far {best['step_s'] * 1e3:,.0f} ms/step" if best else ""
            log(f"  {i + 1}/{len(scored)} planned in {time.perf_counter() - t0:.0f} s{so_far}")
    return {
        "gpu": gpu,
        "candidates": len(cands),
        "pruned_by_arithmetic": pruned,
        "host_budget": host_budget,
        "planned": len(rows),
        "rows": rows,
        "best": best,
        "seconds": time.perf_counter() - t0,
    }


def _row(change: dict[str, str], p: Planned, fits: bool, c: Config) -> dict[str, Any]:
    tokens = c.train.batch_size * c.train_seq_len
    return {
        "change": change,
        "peak_bytes": p.peak,
        "host_bytes": p.host,
        "step_s": p.step_s,
        "tokens_per_s": tokens / p.step_s if p.step_s else None,
        "fits": fits,
    }


def tune_predicted(
    cfg: Config,
    gpu: str,
    host_memory: int | None,
    out_dir: Path,
    *,
    world_size: int = 1,
    interconnect: str = "nvlink",
    log=print,
) -> dict[str, Any]:
    """The predicted search for `gpu` (one process, or `world_size` on a mesh over
    `interconnect`: plan/mesh_search.py); best.toml, tune.json and tune.md in `out_dir`."""
    from onegpu.plan.targets import CUDA_OVERHEAD_BYTES
    from onegpu.tools.tune import candidates

    budget = GPUS[gpu].memory_bytes - CUDA_OVERHEAD_BYTES
    host_budget = host_memory or machine_ram()
    if world_size > 1:
        from onegpu.plan.mesh_search import search_meshes

        result = search_meshes(
            cfg, gpu, gpu_caps(gpu), world_size, interconnect, budget, host_budget, log=log
        )
        result["host_budget"] = host_budget
        table = mesh_table(result, budget)
    else:
        cands = candidates(cfg, "cuda", with_compile=False, budget="budget:auto")
        result = search(cfg, cands, gpu, budget, host_budget, log)
        table = predicted_table(result, budget)
    files = {"tune.json": json.dumps(result, indent=1) + "\n", "tune.md": table}
    if result["best"] is not None:
        files["best.toml"] = to_toml(with_overrides(cfg, result["best"]["change"]))
    write_together(out_dir, files)
    if result["best"] is None:
        (out_dir / "best.toml").unlink(missing_ok=True)  # an earlier search's: not this one's
        where = f"{world_size} x {gpu}" if world_size > 1 else gpu
        raise ConfigError(
            "--gpu",
            f"nothing in the search fits {where} with {host_budget / 2**30:.1f} GiB of "
            "host memory; --host-memory BYTES plans for a larger host, or `onegpu plan "
            "--largest` says which size of this model fits",
        )
    return result


def mesh_table(result: dict[str, Any], budget: int) -> str:
    """tune.md of a mesh search: each candidate planned, fastest predicted first."""
    lines = [
        f"# onegpu tune for {result['world_size']} x {result['gpu']} over "
        f"{result['interconnect']}: predicted, not measured (no such GPU here)",
        "",
        f"{result['candidates']} candidates (every mesh layout x checkpointing x micro-batch); "
        f"{result['skipped_by_arithmetic']} skipped by arithmetic; {result['planned']} planned "
        f"(fastest predicted step first, until one fit) in {result['seconds']:.0f} s. Budget "
        f"{budget / 2**30:.1f} GiB per GPU.",
        "",
        "| layout, checkpointing, micro-batch | predicted tokens/s | largest rank | fits |",
        "|---|---|---|---|",
    ]
    for r in result["rows"]:
        lines.append(
            f"| {r['label']} | {r['tokens_per_s']:,.0f} | {r['peak_bytes'] / 2**30:,.2f} GiB | "
            f"{'yes' if r['fits'] else 'no'} |"
        )
    if result["best"]:
        flags = " ".join(f"--{k} {v}" for k, v in result["best"]["overrides"].items())
        lines += ["", f"Fastest that fits: {result['best']['label']} ({flags}; best.toml)."]
    return "\n".join(lines) + "\n"


def predicted_table(result: dict[str, Any], budget: int) -> str:
    from onegpu.tools.tune_report import trial_label

    rows = sorted((r for r in result["rows"] if r["fits"]), key=lambda r: r["step_s"])[:10]
    lines = [
        f"# onegpu tune for {result['gpu']}: predicted, not measured (no such GPU here)",
        "",
        f"{result['candidates']} candidates; {result['pruned_by_arithmetic']} pruned by "
        f"arithmetic; {result['planned']} planned (fastest lower bound first, until none left "
        f"could be faster) in {result['seconds']:.0f} s. Budget {budget / 2**30:.1f} GiB on the "
        f"device, {result['host_budget'] / 2**30:.1f} GiB on the host. Fastest that fit:",
        "",
        "| configuration | predicted tokens/s | device | host |",
        "|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {trial_label(r['change'])} | {r['tokens_per_s']:,.0f} | "
            f"{r['peak_bytes'] / 2**30:,.2f} GiB | {r['host_bytes'] / 2**30:,.1f} GiB |"
        )
    if result["best"]:
        lines += [
            "",
            f"Fastest that fits: {trial_label(result['best']['change'])} (best.toml; "
            "confirmed by following the full model).",
        ]
    return "\n".join(lines) + "\n"
