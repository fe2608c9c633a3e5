"""`onegpu plan`: the predicted memory anatomy of a step, the analytic figures beside it, the
predicted speed, and whether it fits a GPU (and if not, the cheapest changes that make it fit).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from onegpu.config import (
    Config,
    ConfigError,
    DistConfig,
    check_batch_split,
    check_distributed,
    resolve_strategy,
    with_offload_params,
)
from onegpu.distributed.plan import per_rank_memory
from onegpu.perf.devices import GPUS, GiB, cpu_peak_flops
from onegpu.perf.flops import recompute_factor
from onegpu.techniques.precision import DeviceCaps
from onegpu.tools.offload_time import offload_costs
from onegpu.tools.planner import MemoryPlan, plan_memory

# Reserved on a GPU beyond tensors: CUDA context and kernels (~0.3-1 GiB) and allocator slack.
CUDA_OVERHEAD_BYTES = GiB // 2
EFFICIENCY = 0.4  # assumed fraction of peak FLOP/s a training step reaches (a prediction)


def korthikanti_bytes(cfg: Config, micro_batch: int) -> int:
    """Activation bytes per layer of Korthikanti et al., "Reducing Activation Recomputation in
    Large Transformer Models" (arXiv:2205.05198), 16-bit activations with
    dropout and the full attention matrix stored: s*b*h*(34 + 5*a*s/h)."""
    s, h, a = cfg.train_seq_len, cfg.model.d_model, cfg.model.n_head
    return int(s * micro_batch * h * (34 + 5 * a * s / h))


def gpu_caps(gpu: str) -> DeviceCaps:
    """What a GPU of the table runs natively: decides `auto` precision as on the real GPU."""
    peak = GPUS[gpu].peak
    return DeviceCaps(type="cuda", bf16="bf16" in peak, tf32="tf32" in peak)


GPU_COUNTS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)
"""World sizes `onegpu plan --gpu` tries for 'how many GPUs does it need'."""


def process_share(cfg: Config, world_size: int) -> Config:
    """The config one of `world_size` processes runs, as one process: its share of the global
    batch."""
    check_batch_split(cfg, world_size)
    t = cfg.train
    # planned as one process: rank_memory adds what sharding and dist.cpu_offload change
    return dataclasses.replace(
        cfg,
        train=dataclasses.replace(t, batch_size=t.batch_size // world_size),
        dist=DistConfig(),
    )


def rank_memory(cfg: Config, plan: MemoryPlan, world_size: int, strategy: str) -> dict[str, int]:
    """Rank 0's planned bytes (distributed/plan.py) from the plan of one process's share."""
    gathered_16bit = plan.param_dtype == torch.float32 and plan.compute_dtype != torch.float32
    single = dict(plan.memory)
    if gathered_16bit and strategy == "fsdp":
        # FSDP's mixed precision computes with the gathered 16-bit weights themselves (counted
        # under `gathered`): autocast's saved copies of the weights do not exist
        single["activations"] -= plan.weight_copies_at_peak
    return per_rank_memory(
        single,
        plan.param_shapes,
        plan.block_numels,
        world_size=world_size,
        strategy=strategy,
        reshard_after_forward=cfg.dist.reshard_after_forward,
        cpu_offload=cfg.dist.cpu_offload,
        gather_bytes=2 if gathered_16bit else plan.param_shapes[0].element_size,
    )


def one_budget(gpu: str | None, memory_bytes: int | None) -> None:
    """--gpu and --memory each set the budget (a GPU of the table, or bytes on this machine's
    device): given both, one would be dropped without a word."""
    if gpu is not None and memory_bytes is not None:
        raise ConfigError("--memory", f"--gpu {gpu} and --memory {memory_bytes} are alternatives; "
                          f"keep --gpu {gpu} to plan for that GPU's memory, or --memory "
                          f"{memory_bytes} for a budget in bytes on this machine")  # fmt: skip


def plan_report(
    cfg: Config,
    gpu: str | None,
    memory_bytes: int | None,
    world_size: int = 1,
    host_memory: int | None = None,
) -> dict[str, Any]:
    """The plan of one process (of `world_size`) on `gpu` (None: this CPU, with an optional
    budget of `memory_bytes`): memory, analytic figures, speed, fit and fixes. What it keeps in
    host memory must fit `host_memory` (default: this machine's RAM) too."""
    one_budget(gpu, memory_bytes)
    if gpu is not None and gpu not in GPUS:
        raise ConfigError("--gpu", f"unknown GPU {gpu!r}; `onegpu plan --gpu list` shows the table")
    if memory_bytes is not None and memory_bytes <= 0:
        raise ConfigError("--memory", f"must be a positive number of bytes, got {memory_bytes}")
    if host_memory is not None and host_memory <= 0:
        raise ConfigError("--host-memory", f"must be a positive number of bytes, got {host_memory}")
    target, caps = ("cuda", gpu_caps(gpu)) if gpu else ("cpu", None)
    cfg = with_offload_params(cfg)  # weights on the host: planned as FSDP2's CPU offload
    strategy = resolve_strategy(cfg.dist, world_size, "--world-size")
    check_distributed(cfg, strategy, world_size)  # what training would refuse, refused here
    plan = plan_memory(process_share(cfg, world_size), target, caps)
    distributed = strategy != "none"
    mem = rank_memory(cfg, plan, world_size, strategy) if distributed else plan.memory
    report = _memory_report(cfg, plan, mem)
    if distributed:
        report["dist"] = {
            "strategy": strategy,
            "world_size": world_size,
            "reshard_after_forward": cfg.dist.reshard_after_forward,
            "cpu_offload": cfg.dist.cpu_offload,
            "single_device_share": plan.memory,
        }
    if gpu and (distributed or not _fits(mem, GPUS[gpu].memory_bytes)):
        report["gpus_needed"] = gpus_needed(
            cfg, plan, world_size, GPUS[gpu].memory_bytes, target, caps
        )
    report.update(predicted_speed(cfg, plan, gpu, world_size))
    capacity = GPUS[gpu].memory_bytes if gpu else memory_bytes
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
        if not report["fits"] and not distributed:
            from onegpu.tools.fixes import fixes_for

            report["fixes"] = fixes_for(cfg, capacity - overhead, target, caps,
                                        base_peak=mem["peak"], gpu=gpu, host_budget=host)  # fmt: skip
    return report


def machine_ram() -> int:
    """This machine's physical memory in bytes (the default --host-memory)."""
    import os

    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


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
        },
        "params": n,
        "memory": mem,
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


def predicted_speed(
    cfg: Config, plan: MemoryPlan, gpu: str | None, world_size: int
) -> dict[str, Any]:
    """The predicted step time: counted FLOPs at EFFICIENCY of the peak for the compute dtype
    (a GPU's datasheet, or this CPU's measured matmul peak); {} when the peak is unknown."""
    if gpu:
        spec = GPUS[gpu]
        peak_flops = spec.peak.get(plan.peak_key, spec.peak["fp32"])
    else:
        peak_flops = cpu_peak_flops(plan.compute_dtype)
    if not peak_flops:
        return {}
    tokens = cfg.train.batch_size * cfg.train_seq_len
    recompute = recompute_factor(cfg.memory.checkpointing)
    compute_s = plan.flops_per_token * recompute * tokens / (peak_flops * EFFICIENCY * world_size)
    offload = offload_costs(cfg, plan, gpu, world_size)
    step_s = max(compute_s, offload.get("link_s", 0.0)) + offload.get("host_step_s", 0.0)
    return {"predicted_step_time_s": step_s, "predicted_tokens_per_s": tokens / step_s,
            "predicted_compute_s": compute_s, "efficiency_assumed": EFFICIENCY,
            "recompute_factor": recompute,
            **({"offload": offload} if offload else {})}  # fmt: skip


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
    shares: dict[bool, MemoryPlan] = {cfg.grad_accum_steps // world_size > 1: plan}
    rows = []
    for n in GPU_COUNTS:
        if t.batch_size % (t.micro_batch_size * n):
            continue
        several = cfg.grad_accum_steps // n > 1
        if several not in shares:
            shares[several] = plan_memory(process_share(cfg, n), target, caps)
        peak = rank_memory(cfg, shares[several], n, "fsdp" if n > 1 else "none")["peak"]
        rows.append({"world_size": n, "peak": peak, "fits": peak + CUDA_OVERHEAD_BYTES <= capacity})
    fewest = next((r["world_size"] for r in rows if r["fits"]), None)
    return {"fewest": fewest, "rows": rows}
