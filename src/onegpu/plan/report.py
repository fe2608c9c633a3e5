"""`onegpu plan`: the predicted memory anatomy of a step, the analytic figures beside it, the
predicted speed, and whether it fits a GPU (and if not, the cheapest changes that make it fit).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from onegpu.config import (
    Config,
    ConfigError,
    check_distributed,
    parse_checkpointing,
    resolve_strategy,
)
from onegpu.offload.weights import with_offload_params
from onegpu.perf.devices import GPUS, known_gpu
from onegpu.perf.host_memory import machine_ram
from onegpu.plan.budget import plan_budget
from onegpu.plan.data_share import data_share
from onegpu.plan.fixes import fixes_for
from onegpu.plan.memory import MemoryPlan, plan_memory
from onegpu.plan.mesh import mesh_plans, mesh_section, predicted_step
from onegpu.plan.ranks import needs_rank_plans
from onegpu.plan.targets import (
    CUDA_OVERHEAD_BYTES,
    GPU_COUNTS,
    as_a_process_of,
    check_device_cap,
    device_capacity,
    gpu_caps,
    one_budget,
    predicted_speed,
    process_share,
    rank_memory,
    rank_peak,
)


def korthikanti_bytes(cfg: Config, micro_batch: int) -> int:
    """Activation bytes per layer of Korthikanti et al., "Reducing Activation Recomputation in
    Large Transformer Models" (arXiv:2205.05198), 16-bit activations with
    dropout and the full attention matrix stored: s*b*h*(34 + 5*a*s/h)."""
    s, h, a = cfg.train_seq_len, cfg.model.d_model, cfg.model.n_head
    return int(s * micro_batch * h * (34 + 5 * a * s / h))


def _check_budgets(
    gpu: str | None, memory_bytes: int | None, host_memory: int | None, world_size: int
) -> None:
    if world_size > 1:  # the mesh searches plan for the whole GPU
        one_budget(gpu, memory_bytes)
    known_gpu(gpu)
    check_device_cap(gpu, memory_bytes)
    if memory_bytes is not None and memory_bytes <= 0:
        raise ConfigError("--memory", f"must be a positive number of bytes, got {memory_bytes}")
    if host_memory is not None and host_memory <= 0:
        raise ConfigError("--host-memory", f"must be a positive number of bytes, got {host_memory}")


def plan_report(
    cfg: Config,
    gpu: str | None,
    memory_bytes: int | None,
    world_size: int = 1,
    host_memory: int | None = None,
    interconnect: str = "nvlink",
) -> dict[str, Any]:
    """The plan of one process (of `world_size`) on `gpu` (None: this CPU, with an optional
    budget of `memory_bytes`, timed with each process's threads): memory, analytic figures,
    speed, fit and fixes. What it keeps in host memory must fit `host_memory` (default: this
    machine's RAM) too. A device mesh (tensor or pipeline parallelism, HSDP) plans each stage's
    rank as itself, with the bytes each dimension sends over `interconnect`."""
    _check_budgets(gpu, memory_bytes, host_memory, world_size)
    with as_a_process_of(world_size, "cuda" if gpu else "cpu"):
        return _plan_report(cfg, gpu, memory_bytes, world_size, host_memory, interconnect)


def _plan_report(
    cfg: Config,
    gpu: str | None,
    memory_bytes: int | None,
    world_size: int,
    host_memory: int | None,
    interconnect: str,
) -> dict[str, Any]:
    target, caps = ("cuda", gpu_caps(gpu)) if gpu else ("cpu", None)
    cfg = with_offload_params(cfg)  # weights on the host: planned as FSDP2's CPU offload
    strategy = resolve_strategy(cfg.dist, world_size, "--world-size")
    check_distributed(cfg, strategy, world_size)  # what training would refuse, refused here
    cfg, budgeted = _decide_budget(cfg, gpu, memory_bytes)
    if needs_rank_plans(cfg, world_size):
        return _mesh_report(cfg, gpu, memory_bytes, world_size, host_memory, interconnect)
    distributed = strategy != "none"
    # FSDP's bytes are the most over the step's stretches (and with a GPU, `gpus_needed`'s)
    stretches = distributed or gpu is not None
    plan = plan_memory(process_share(cfg, world_size), target, caps, by_segment=stretches)
    mem = plan.memory
    if distributed:  # rank 0's peak, and where it comes: not always where one process's does
        mem, moment = rank_peak(cfg.dist, plan, world_size, strategy)
        if (moment.memory["peak"], moment.phase) != (plan.memory["peak"], plan.peak_phase):
            where = "in a block" if moment.in_a_block else "outside the blocks"
            op = f"rank 0's own peak, {where}"
            plan = dataclasses.replace(plan, peak_phase=moment.phase, peak_op=op)
    report = _memory_report(cfg, plan, mem)
    if budgeted:
        report["checkpointing_budget"] = budgeted
    if distributed:
        report["dist"] = _data_parallel_section(cfg, plan, strategy, gpu, world_size, interconnect)
    capacity = device_capacity(gpu, memory_bytes)
    if gpu and (distributed or not _fits(mem, capacity)):
        report["gpus_needed"] = gpus_needed(cfg, plan, world_size, capacity, target, caps)
    report.update(predicted_speed(cfg, plan, gpu, world_size))
    report.update(data_share(cfg, report.get("predicted_tokens_per_s")))
    if capacity:
        overhead = CUDA_OVERHEAD_BYTES if gpu else 0
        need = mem["peak"] + overhead
        host = host_memory or machine_ram()
        report.update(
            capacity_bytes=capacity,
            fits=need <= capacity and mem.get("host", 0) <= host,
            headroom_bytes=capacity - need,
            host_memory_bytes=host,
        )
        if not report["fits"] and distributed and gpu:
            report["mesh_fixes"] = _mesh_fixes(cfg, gpu, world_size, interconnect, host)
        if not report["fits"] and not distributed:
            report["fixes"] = fixes_for(
                cfg,
                capacity - overhead,
                target,
                caps,
                base_peak=mem["peak"],
                gpu=gpu,
                host_budget=host,
            )
    return report


def _decide_budget(
    cfg: Config, gpu: str | None, memory_bytes: int | None
) -> tuple[Config, dict[str, Any] | None]:
    """`budget:` checkpointing decided for the planned device (budget:auto: its memory, less
    the CUDA context on a GPU); other checkpointing as it is."""
    if parse_checkpointing(cfg.memory.checkpointing).kind != "budget":
        return cfg, None
    target, caps = ("cuda", gpu_caps(gpu)) if gpu else ("cpu", None)
    capacity = device_capacity(gpu, memory_bytes)
    if gpu and capacity:
        capacity -= CUDA_OVERHEAD_BYTES
    return plan_budget(cfg, target, caps, capacity)


def _data_parallel_section(
    cfg: Config, plan: MemoryPlan, strategy: str, gpu: str | None, world_size: int, link: str
) -> dict[str, Any]:
    """The report's `dist` part for plain DDP / FSDP: the strategy, the bytes sent per step
    and the step time with them (plan/mesh.py)."""
    return {
        "strategy": strategy,
        "world_size": world_size,
        "reshard_after_forward": cfg.dist.reshard_after_forward,
        "cpu_offload": cfg.dist.cpu_offload,
        "single_device_share": plan.memory,
        **predicted_step(cfg, plan, gpu, world_size, link),
    }


def _mesh_report(
    cfg: Config,
    gpu: str | None,
    memory_bytes: int | None,
    world_size: int,
    host_memory: int | None,
    interconnect: str,
) -> dict[str, Any]:
    """The largest rank's plan as the report's memory, each stage's beside it, the bytes each
    mesh dimension sends and the predicted step (plan/mesh.py)."""
    target, caps = ("cuda", gpu_caps(gpu)) if gpu else ("cpu", None)
    plans, largest = mesh_plans(cfg, target, caps, world_size)
    plan = plans[largest]
    followed = tuple(dict.fromkeys(f for p in plans.values() for f in p.provisional))
    report = _memory_report(cfg, dataclasses.replace(plan, provisional=followed), plan.memory)
    report["dist"] = mesh_section(cfg, plans, gpu, world_size, interconnect)
    report["dist"]["largest_rank"] = largest
    capacity = GPUS[gpu].memory_bytes if gpu else memory_bytes
    if capacity:
        need = plan.memory["peak"] + (CUDA_OVERHEAD_BYTES if gpu else 0)
        host = host_memory or machine_ram()
        report.update(
            capacity_bytes=capacity,
            fits=need <= capacity and plan.memory.get("host", 0) * world_size <= host,
            headroom_bytes=capacity - need,
            host_memory_bytes=host,
        )
        if not report["fits"] and gpu:
            report["mesh_fixes"] = _mesh_fixes(cfg, gpu, world_size, interconnect, host)
    return report


def _mesh_fixes(
    cfg: Config, gpu: str, world_size: int, interconnect: str, host: int
) -> dict[str, Any]:
    """The fix list of N processes: the other layouts of the mesh (TP, PP, HSDP), with
    checkpointing and micro-batch, fastest predicted first until one fits."""
    from onegpu.plan.mesh_search import search_meshes

    budget = GPUS[gpu].memory_bytes - CUDA_OVERHEAD_BYTES
    return search_meshes(cfg, gpu, gpu_caps(gpu), world_size, interconnect, budget, host)


def gpu_table() -> str:
    """`onegpu plan --gpu list`: the GPUs a plan can target, their memory and peaks."""
    lines = ["name        memory   peak dense TFLOP/s (fp32 / tf32 / bf16 / fp16)"]
    for g in GPUS.values():
        peaks = "/".join(
            f"{g.peak[k] / 1e12:g}" if k in g.peak else "-"
            for k in ("fp32", "tf32", "bf16", "fp16")
        )
        lines.append(f"{g.name:<10} {g.memory_bytes / 2**30:5.0f} GiB   {peaks}")
    return "\n".join(lines)


def _memory_report(cfg: Config, plan: MemoryPlan, mem: dict[str, int]) -> dict[str, Any]:
    n = plan.n_params
    return {
        "config": {
            "precision": plan.precision,
            "batch": cfg.train.batch_size,
            "micro_batch": cfg.train.micro_batch_size,
            "seq_len": cfg.train_seq_len,
            "checkpointing": cfg.memory.checkpointing,
            "optimizer": cfg.optim.name,
            "loss_chunk": plan.loss_chunk,
            "loss_kernel": plan.loss_kernel,
            "attention": plan.attention,
            "follows_unkept_timings": list(plan.provisional),
        },
        "params": n,
        "memory": mem,
        "host_by_kind": plan.host_by_kind,
        "prediction": True,
        "peak_at": f"{plan.peak_phase} ({plan.peak_op})",
        "saved_activations_per_micro_batch": plan.saved_per_micro_batch,
        "saved_by_kind": plan.saved_by_kind,
        "saved_by_block": plan.saved_by_block,
        "bytes_per_param": {g: mem[g] / n for g in ("params", "grads", "optimizer")},
        "korthikanti_bytes_per_layer": korthikanti_bytes(cfg, cfg.train.micro_batch_size),
        "plan_seconds": plan.seconds,
        "flops_per_token": plan.flops_per_token,
    }


def _fits(mem: dict[str, int], capacity: int) -> bool:
    return mem["peak"] + CUDA_OVERHEAD_BYTES <= capacity


def gpus_needed(
    cfg: Config, plan: MemoryPlan, world_size: int, capacity: int, target: str, caps
) -> dict[str, Any]:
    """Rank 0's planned peak on 1, 2, 4, 8, ... GPUs of `capacity` bytes (FSDP on several, as
    `dist.strategy auto`), and the fewest that fit. World sizes the global batch does not split
    into are left out. A share of one micro-batch per process and a share of several peak
    differently (gradients are alive across micro-batches), so each kind is planned once."""
    t = cfg.train
    shares: dict[bool, MemoryPlan] = {}
    if plan.segments:  # each stretch followed, as FSDP's bytes need
        shares[cfg.grad_accum_steps // world_size > 1] = plan
    rows = []
    for n in GPU_COUNTS:
        if t.batch_size % (t.micro_batch_size * n):
            continue
        several = cfg.grad_accum_steps // n > 1
        if several not in shares:
            shares[several] = plan_memory(process_share(cfg, n), target, caps, by_segment=True)
        peak = rank_memory(cfg.dist, shares[several], n, "fsdp" if n > 1 else "none")["peak"]
        rows.append({"world_size": n, "peak": peak, "fits": peak + CUDA_OVERHEAD_BYTES <= capacity})
    fewest = next((r["world_size"] for r in rows if r["fits"]), None)
    return {"fewest": fewest, "rows": rows}
