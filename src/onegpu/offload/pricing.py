"""What offloading adds to a planned step: the bytes that cross the host link and the CPU's
optimizer step (a prediction, labelled as one; docs/offload.md).

- memory.offload_optimizer: every micro-batch's gradients go to the host (one parameter-sized
  copy each), the updated weights come back once per step.
- memory.offload_activations: every micro-batch's saved activations go to the host in forward
  and come back in backward.
- memory.offload_states: every parameter's states come to the device for its step and go
  back, once per step, beside the last micro-batch's backward when stepped in it, after
  backward otherwise (`exposed_link`); the CPU computes nothing.
- FSDP's CPU offload (memory.offload_params, dist.cpu_offload): every micro-batch gathers the
  weights to the device for forward and again for backward (once, with reshard_after_forward
  false) and sends the gradients back; each process moves its shard over its own link.

The copies run on a side stream beside compute, so the step is predicted at the longer of the
two, plus the CPU's optimizer step, which waits for the last gradient (and the next forward for
its weights). With `optim.in_backward` each host copy steps as its gradient lands, on a worker
thread while the device goes on: the last micro-batch's backward hides that much of the host
step (`exposed_host_step`). On a CPU plan the device and the host are one memory: no link,
only the step.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from onegpu.config import Config
from onegpu.distributed.shares import shard_fraction
from onegpu.perf.devices import GPUS

LINK_EFFICIENCY = 0.8
"""Assumed fraction of the link's datasheet rate that pinned, large copies reach."""


HostStepRate = Callable[[str, torch.dtype], tuple[float, str]]
"""(optimizer, weights' dtype) -> (parameters/s of the host CPU's step, how it was obtained):
optim/host_step.py's `host_step_rate`, handed in by the planner (optimizers sit above offload)."""


def offload_costs(
    cfg: Config, plan: Any, gpu: str | None, world_size: int, host_step_rate: HostStepRate
) -> dict[str, Any]:
    """{} when nothing is offloaded; else the link bytes and seconds and the host step."""
    fsdp_host = cfg.dist.cpu_offload
    n_micro = cfg.grad_accum_steps // world_size
    moved = 2 * plan.offloaded_per_micro_batch * n_micro  # activations: out and back
    out: dict[str, Any] = {"host_step_s": 0.0}
    if cfg.memory.offload_optimizer or fsdp_host:
        share = shard_fraction(plan.param_shapes, world_size) if fsdp_host else 1.0
        numel = sum(p.numel for p in plan.param_shapes) * share
        stored = sum(p.numel * p.element_size for p in plan.param_shapes) * share
        if fsdp_host:
            gathers = 2 if cfg.dist.reshard_after_forward else 1
            gathered = numel * (2 if plan.compute_dtype != plan.param_dtype else 4)
            moved += n_micro * (gathers * gathered + stored)
        else:
            moved += n_micro * stored + stored
        rate, how = host_step_rate(cfg.optim.name, plan.param_dtype)  # the host's weights
        out.update(host_step_s=numel / rate, host_step_source=how)
    states = 0
    if cfg.memory.offload_states:  # each parameter's states come for its step and go back
        states = 2 * plan.host_by_kind.get("optimizer states", 0)
        moved += states
    if not moved:
        return {}
    out["link_bytes"] = int(moved)
    if gpu:
        link = GPUS[gpu].host_link * LINK_EFFICIENCY
        out.update(link_s=moved / link, link_rate=link)
        if states:
            out["states_link_s"] = states / link
    return out


BACKWARD_SHARE = 2 / 3
"""Backward's share of a micro-batch's compute (twice the forward's matmuls)."""


def exposed_host_step(cfg: Config, host_step_s: float, compute_s: float, world_size: int) -> float:
    """The part of the host step the device waits for: all of it after backward, or, stepped
    in backward, what the last micro-batch's backward does not hide."""
    if not (cfg.optim.in_backward and cfg.memory.offload_optimizer):
        return host_step_s
    n_micro = max(1, cfg.grad_accum_steps // world_size)
    return max(0.0, host_step_s - compute_s * BACKWARD_SHARE / n_micro)


def exposed_link(cfg: Config, offload: dict[str, Any], compute_s: float, world_size: int) -> float:
    """The step time the host link adds on top of compute. The copies of activations,
    gradients and weights run beside compute (the longer of the two counts). The optimizer
    states' trips (memory.offload_states) run beside backward when the step is in backward
    (what the last micro-batch's backward does not hide is exposed), and after it otherwise,
    one parameter after another: all of them exposed."""
    link_s = offload.get("link_s", 0.0)
    states_s = offload.get("states_link_s", 0.0)
    beside = max(compute_s, link_s - states_s) - compute_s
    if cfg.optim.in_backward:
        n_micro = max(1, cfg.grad_accum_steps // world_size)
        states_s = max(0.0, states_s - compute_s * BACKWARD_SHARE / n_micro)
    return beside + states_s
