"""`onegpu train` plans before it allocates: a run the planner says cannot fit this machine is
refused at once, with the planner's figure and its fixes, instead of swapping or being killed
by the kernel minutes later.

The plan is the search's (two shallow copies extrapolated in depth: a second or two at gpt2-xl)
and is cached by everything that changes a step's memory, so a repeated start costs a file
read. What it is compared with: on a CPU, the memory available now (MemAvailable: RAM not
needed by others, page cache included); on a GPU, the device's free memory (less the CUDA
context) and the host's available memory for what is offloaded there.
"""

from __future__ import annotations

import functools
import hashlib
import json
import sys
from pathlib import Path
from typing import Any

import torch

from onegpu.cache import cached, has
from onegpu.config import Config, ConfigError, parse_checkpointing, to_dict
from onegpu.perf.devices import GiB
from onegpu.perf.host_memory import available_host_bytes
from onegpu.plan.budget import plan_budget
from onegpu.techniques.precision import resolve_precision

# What does not change a step's memory (left out of the cache key).
_IRRELEVANT_SECTIONS = ("out", "checkpoint", "dist")
_IRRELEVANT_TRAIN = (
    "max_steps",
    "log_every",
    "eval_every",
    "eval_batches",
    "resume",
    "resume_new_data",
    "skip_memory_check",
    "seed",
    "max_consecutive_skips",
)


@functools.cache
def source_fingerprint() -> str:
    """onegpu's own code, hashed: a plan cached by another version of the planner (or of what
    it builds) is planned again, not served."""
    import onegpu

    digest = hashlib.sha256(onegpu.__version__.encode())
    for path in sorted(Path(onegpu.__file__).parent.rglob("*.py")):
        digest.update(path.read_bytes())
    return digest.hexdigest()[:16]


def planned_need(cfg: Config, target: str, world_size: int = 1) -> dict[str, int]:
    """{'peak', 'host'} of `cfg` on `target` (of one of `world_size` processes: its share),
    planned once per configuration."""
    key_cfg = to_dict(cfg)
    for section in _IRRELEVANT_SECTIONS if world_size == 1 else ("out", "checkpoint"):
        key_cfg.pop(section, None)
    for name in _IRRELEVANT_TRAIN:
        key_cfg["train"].pop(name, None)
    parts = [key_cfg, target, world_size, torch.__version__, source_fingerprint()]
    if target == "cpu" and cfg.train.precision == "auto":  # a CPU's: from its measured peaks
        parts.append(resolve_precision("auto", torch.device("cpu")).name)
    blob = json.dumps(parts, sort_keys=True, default=str)
    key = hashlib.sha256(blob.encode()).hexdigest()[:24]
    return cached(
        "start-plans.json", key, lambda: _plan(cfg, target, world_size), valid=has("peak", "host")
    )


def _plan(cfg: Config, target: str, world_size: int) -> dict[str, int]:
    from onegpu.plan.fixes import planned

    if world_size == 1:
        p = planned(cfg, target, None, None, fast=True, speed=False)
        return {"peak": p.peak, "host": p.host}
    from onegpu.config import resolve_strategy
    from onegpu.offload.weights import with_offload_params
    from onegpu.plan.depth import plan_extrapolated
    from onegpu.plan.ranks import needs_rank_plans, rank_needs
    from onegpu.plan.targets import process_share, rank_memory

    if needs_rank_plans(cfg, world_size):  # a mesh: each stage's rank followed as itself
        return max(rank_needs(cfg, target, world_size).values(), key=lambda n: n["peak"])

    cfg = with_offload_params(cfg)  # weights on the host: planned as FSDP2's CPU offload
    share = plan_extrapolated(process_share(cfg, world_size), target)
    strategy = resolve_strategy(cfg.dist, world_size)
    mem = rank_memory(cfg.dist, share, world_size, strategy)
    return {"peak": mem["peak"], "host": mem.get("host", 0)}


def check_memory(
    cfg: Config, device: torch.device, world_size: int = 1, per_machine: int = 1
) -> dict[str, Any] | None:
    """ConfigError (exit 2) where the plan does not fit this machine; None when the check is
    off; else what was compared ({'skipped': why} where no plan could be made).

    The check guards a run, so it never ends one the user could have run: the configuration's
    own errors (ConfigError, from the build's checks for this device or the plan's) are raised
    as the run would raise them, and anything else that stops the planner (a technique whose
    step reads values, which fake tensors lack) is one line on stderr, and the run starts
    unchecked. Callable wherever a run knows its config and device. Under torchrun each
    process checks its own share (of `world_size`) against its device, and against its part
    of the host memory the `per_machine` processes on this machine share."""
    if cfg.train.skip_memory_check:
        return None
    from onegpu.plan.memory import Unplannable

    target = "cuda" if device.type == "cuda" else "cpu"
    try:
        _device_refusals(cfg, device)
        need = planned_need(cfg, target, world_size)
    except Unplannable as e:  # the run itself is fine: say so and train unchecked
        return _skipped(str(e))
    except ConfigError:
        raise  # the user's configuration: refused now as the build would refuse it
    except Exception as e:  # the planner's limit, not the run's
        first = next(iter(str(e).strip().splitlines()), "")
        return _skipped(f"could not plan this configuration ({type(e).__name__}: {first})")
    device_free, host_free = free_bytes(device, per_machine)
    if target == "cuda":
        short = need["peak"] > device_free or need["host"] > host_free
    else:  # one memory: the device's peak and what is "offloaded" share it
        short = need["peak"] + need["host"] > host_free
    if short:
        raise ConfigError(
            "train.skip_memory_check", _refusal(cfg, need, device_free, host_free, target)
        )
    return {"need": need, "device_free": device_free, "host_free": host_free}


def free_bytes(device: torch.device, per_machine: int = 1) -> tuple[int, int]:
    """(device, host) bytes free now for one of `per_machine` processes: on a GPU its free
    memory less the CUDA context, on a CPU the host's available memory (one memory: both)."""
    host_free = available_host_bytes() // max(per_machine, 1)
    if device.type != "cuda":
        return host_free, host_free
    from onegpu.plan.targets import CUDA_OVERHEAD_BYTES

    free, _ = torch.cuda.mem_get_info(device)
    return free - CUDA_OVERHEAD_BYTES, host_free


def _skipped(why: str) -> dict[str, Any]:
    print(f"onegpu: memory check skipped: {why}", file=sys.stderr)
    return {"skipped": why}


def _device_refusals(cfg: Config, device: torch.device) -> None:
    """What the build refuses on this device only with real tensors (the plan's fake ones run
    the CPU's shape rules): an SDPA kernel the device lacks. Checked before planning, so the
    answer is the build's one line, not a planner failure."""
    from onegpu.backends.torch.build import resolve
    from onegpu.techniques.attention import check_attention_backend

    resolved = resolve(cfg, device, timed=False)
    check_attention_backend(resolved.attention, device, resolved.precision.param_dtype)


def _refusal(
    cfg: Config, need: dict[str, int], device_free: int, host_free: int, target: str
) -> str:
    from onegpu.plan.fixes import fixes_for

    budget = device_free if target == "cuda" else host_free - need["host"]
    try:
        found = fixes_for(
            cfg, max(budget, 0), target, base_peak=need["peak"], host_budget=host_free
        )
    except Exception:  # a change the search cannot plan: the refusal, without the fixes
        found = []
    best = next((f for f in found if "best_overrides" in f), None)
    where = "this GPU has" if target == "cuda" else "this machine has"
    fix = (
        "fits with " + " ".join(f"--{k} {v}" for k, v in best["best_overrides"].items())
        if best
        else "nothing in the planner's list makes it fit: a smaller model, shorter "
        "sequences or a smaller batch"
    )
    host = f" (+{need['host'] / GiB:.1f} GiB on the host)" if need["host"] else ""
    return (
        f"the planner predicts a peak of {need['peak'] / GiB:.1f} GiB{host}; {where} "
        f"{device_free / GiB:.1f} GiB available; it {fix}; or start anyway with "
        "--train.skip_memory_check true"
    )


def budget_for_run(cfg: Config, device: torch.device) -> Config:
    """A run's `budget:` checkpointing decided on its device (budget:auto: the memory free
    there now), said in one line; any other checkpointing as it is."""
    if parse_checkpointing(cfg.memory.checkpointing).kind != "budget":
        return cfg
    target = "cuda" if device.type == "cuda" else "cpu"
    resolved, decided = plan_budget(cfg, target, None, free_bytes(device)[0])
    print(
        f"onegpu: checkpointing {cfg.memory.checkpointing} -> {decided['checkpointing']} "
        f"(planned peak {decided['planned_peak'] / 2**20:,.1f} MiB, "
        f"{decided['recompute_factor'] - 1:.1%} of a step recomputed)",
        flush=True,
    )
    return resolved
