"""What a plan is compared with and priced at: a GPU of the table or this machine (its RAM, the
CUDA context), one process's share of a torchrun job and its bytes, and the predicted speed."""

from __future__ import annotations

import contextlib
import dataclasses
import os
from collections.abc import Iterator
from typing import Any

import torch

from onegpu.config import Config, ConfigError, DistConfig, check_batch_split
from onegpu.config.layout import resolve_layout
from onegpu.distributed.shares import per_rank_memory
from onegpu.offload.pricing import exposed_host_step, exposed_link, offload_costs
from onegpu.optim.host_step import host_step_rate
from onegpu.perf.devices import GPUS, GiB, cpu_peak_flops, cublas_workspace_bytes
from onegpu.perf.flops import recompute_factor
from onegpu.plan.memory import MemoryPlan, Moment
from onegpu.techniques.precision import DeviceCaps

# Reserved on a GPU beyond tensors: CUDA context and kernels (~0.3-1 GiB) and allocator slack.
CUDA_OVERHEAD_BYTES = GiB // 2


EFFICIENCY = 0.4  # assumed fraction of peak FLOP/s a training step reaches (a prediction)
HOST_SECONDS_PER_OP = 28e-6
"""Host time per op of an eager step on a GPU: Python, autograd, the dispatcher and the kernel
launch. A GPU step cannot be shorter than its host's launches of its ops. The H200 host of
2026-11-28 ran model A's step (460 ops counted by the planner) in 12.8 ms, and B's (596 ops)
in 15.5 ms: 26-28 us an op (benchmarks/results/gpu-nvidia-h200-2026-11-28.md). Their counted
FLOPs took 1.1 and 0.9 ms at EFFICIENCY: those steps wait on the host, not the GPU."""
EAGER_COMPILES = ("none", "auto")
"""The compile settings whose steps the planner's op count follows. `auto` is priced eager: a
run under 100 steps stays eager, and a longer one compiles only where its trial repays it,
which a plan cannot know. A compiled step launches fused kernels, fewer than its ops, and
they are not counted: its predicted time is its FLOPs' alone."""


def gpu_caps(gpu: str) -> DeviceCaps:
    """What a GPU of the table runs natively: decides `auto` precision as on the real GPU."""
    spec = GPUS[gpu]
    workspace = cublas_workspace_bytes(spec.capability)
    return DeviceCaps("cuda", "bf16" in spec.peak, "tf32" in spec.peak, workspace)


GPU_COUNTS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)
"""World sizes `onegpu plan --gpu` tries for 'how many GPUs does it need'."""


def process_share(cfg: Config, world_size: int) -> Config:
    """The config one of `world_size` processes runs, as one process: its data-parallel share
    of the global batch."""
    dp = resolve_layout(cfg.dist, world_size).dp if world_size > 0 else world_size
    check_batch_split(cfg.train, dp)
    t = cfg.train
    # planned as one process: rank_memory adds what sharding and dist.cpu_offload change
    return dataclasses.replace(
        cfg,
        train=dataclasses.replace(t, batch_size=t.batch_size // dp),
        dist=DistConfig(),
    )


def process_threads(world_size: int) -> int:
    """The torch threads each of `world_size` processes on this CPU runs with: torchrun sets
    OMP_NUM_THREADS to 1 for each where the user did not set it (torch.distributed.run), and
    one process runs with this one's."""
    if world_size == 1:
        return torch.get_num_threads()
    try:
        return max(1, int(os.environ["OMP_NUM_THREADS"]))
    except (KeyError, ValueError):
        return 1


@contextlib.contextmanager
def as_a_process_of(world_size: int, target: str = "cpu") -> Iterator[None]:
    """This process timing and reading cached timings (their keys hold the threads) with the
    threads of one of `world_size` CPU processes: a plan for torchrun's processes made in a
    process with all the cores otherwise follows another kernel than the run chose (the tensor-
    parallel plan followed "sdpa" at 2 threads, the run "blocked" at 1: 15% apart). For another
    `target` (a GPU's plan) nothing changes."""
    if target != "cpu":
        yield
        return
    before = torch.get_num_threads()
    torch.set_num_threads(process_threads(world_size))
    try:
        yield
    finally:
        torch.set_num_threads(before)


def rank_memory(
    dist: DistConfig, plan: MemoryPlan, world_size: int, strategy: str
) -> dict[str, int]:
    """Rank 0's planned bytes (distributed/shares.py) from the plan of one process's share."""
    return rank_peak(dist, plan, world_size, strategy)[0]


def rank_peak(
    dist: DistConfig, plan: MemoryPlan, world_size: int, strategy: str
) -> tuple[dict[str, int], Moment]:
    """Rank 0's planned bytes and the moment they come at: the most over the step's moments
    where the plan followed each stretch (`by_segment`). A rank's peak can come at another
    moment than one process's: its gradients are sharded, and what FSDP holds gathered differs
    between forward and backward."""
    gathered_16bit = plan.param_dtype == torch.float32 and plan.compute_dtype != torch.float32

    def at(moment: Moment) -> dict[str, int]:
        single = dict(moment.memory)
        if gathered_16bit and strategy == "fsdp":
            # FSDP's mixed precision computes with the gathered 16-bit weights themselves
            # (counted under `gathered`): autocast's copies of the weights do not exist
            for group, nbytes in moment.weight_copies.items():
                single[group] -= nbytes
        return per_rank_memory(
            single,
            plan.param_shapes,
            plan.block_numels,
            world_size=world_size,
            strategy=strategy,
            reshard_after_forward=dist.reshard_after_forward,
            cpu_offload=dist.cpu_offload,
            gather_bytes=2 if gathered_16bit else plan.param_shapes[0].element_size,
            peak_in_backward=moment.in_backward,
            peak_in_a_block=moment.in_a_block,
        )

    return max(((at(m), m) for m in plan.moments), key=lambda pair: pair[0]["peak"])


def compute_seconds(
    cfg: Config, plan: MemoryPlan, gpu: str | None, world_size: int
) -> float | None:
    """A step's counted FLOPs (recomputation included) at EFFICIENCY of the peak for the
    compute dtype, split over `world_size` devices; None when the peak is unknown."""
    if gpu:
        spec = GPUS[gpu]
        peak_flops = spec.peak.get(plan.peak_key, spec.peak["fp32"])
    else:
        peak_flops = cpu_peak_flops(plan.compute_dtype)
    if not peak_flops:
        return None
    tokens = cfg.train.batch_size * cfg.train_seq_len
    recompute = recompute_factor(cfg.memory.checkpointing)
    return plan.flops_per_token * recompute * tokens / (peak_flops * EFFICIENCY * world_size)


def dispatch_seconds(cfg: Config, plan: MemoryPlan, gpu: str | None) -> float | None:
    """The host's time to launch an eager step's ops on a GPU: 0 on a CPU, whose measured peak
    already prices its ops; None for a compiled step, whose launches are not counted."""
    if not gpu:
        return 0.0
    if cfg.train.compile not in EAGER_COMPILES:
        return None
    return plan.dispatched_ops * HOST_SECONDS_PER_OP


def busy_seconds(compute_s: float, dispatch_s: float | None) -> float:
    """A step's time on its device: its FLOPs' or its host's launches', whichever is longer
    (the GPU runs what the host has launched while the host launches more)."""
    return max(compute_s, dispatch_s or 0.0)


def predicted_speed(
    cfg: Config, plan: MemoryPlan, gpu: str | None, world_size: int
) -> dict[str, Any]:
    """The predicted step time: counted FLOPs at EFFICIENCY of the peak for the compute dtype
    (a GPU's datasheet, or this CPU's measured matmul peak); {} when the peak is unknown."""
    compute_s = compute_seconds(cfg, plan, gpu, world_size)
    if compute_s is None:
        return {}
    tokens = cfg.train.batch_size * cfg.train_seq_len
    recompute = recompute_factor(cfg.memory.checkpointing)
    offload = offload_costs(cfg, plan, gpu, world_size, host_step_rate)
    dispatch_s = dispatch_seconds(cfg, plan, gpu)
    busy_s = busy_seconds(compute_s, dispatch_s)  # what host work beside the step hides behind
    host_step_s = exposed_host_step(cfg, offload.get("host_step_s", 0.0), busy_s, world_size)
    step_s = busy_s + exposed_link(cfg, offload, busy_s, world_size) + host_step_s
    return {
        "predicted_step_time_s": step_s,
        "predicted_tokens_per_s": tokens / step_s,
        "predicted_compute_s": compute_s,
        "predicted_dispatch_s": dispatch_s,
        "dispatched_ops": plan.dispatched_ops,
        "bound": "dispatch" if busy_s > compute_s else "compute",
        "efficiency_assumed": EFFICIENCY,
        "recompute_factor": recompute,
        **({"offload": offload} if offload else {}),
    }


def device_capacity(gpu: str | None, memory_bytes: int | None) -> int | None:
    """The bytes a plan may fill on its device, the CUDA context included: a GPU's memory;
    with --memory as well, that many bytes of tensors on it (below its memory: another
    tool's measured peak, say) and the context; on this machine, --memory."""
    if gpu is None:
        return memory_bytes
    if memory_bytes is None:
        return GPUS[gpu].memory_bytes
    return memory_bytes + CUDA_OVERHEAD_BYTES


def check_device_cap(gpu: str | None, memory_bytes: int | None) -> None:
    """--memory with --gpu: a budget within that GPU's memory."""
    if gpu is None or memory_bytes is None or gpu not in GPUS:
        return
    room = GPUS[gpu].memory_bytes - CUDA_OVERHEAD_BYTES
    if memory_bytes > room:
        raise ConfigError(
            "--memory",
            f"{memory_bytes} bytes of tensors do not fit {gpu} ({room} bytes beside the CUDA "
            f"context); give at most {room}, or leave --memory out to plan for all of it",
        )


def one_budget(gpu: str | None, memory_bytes: int | None) -> None:
    """--gpu and --memory each set the budget (a GPU of the table, or bytes on this machine's
    device): given both, one would be dropped without a word."""
    if gpu is not None and memory_bytes is not None:
        raise ConfigError(
            "--memory",
            f"--gpu {gpu} and --memory {memory_bytes} are alternatives; "
            f"keep --gpu {gpu} to plan for that GPU's memory, or --memory "
            f"{memory_bytes} for a budget in bytes on this machine",
        )
