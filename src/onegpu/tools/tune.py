"""`onegpu tune`: the fastest configuration whose planned peak fits a memory budget.

1. Candidates: micro-batch size (the global batch is kept: the rest is accumulated),
   checkpointing, precision, optimizer, chunked loss and offloading (compile with
   `--with-compile`), crossed.
2. The planner predicts each candidate's peak (fake tensors, seconds); those over the budget
   are pruned before anything runs, and per setting of the rest only the largest micro-batch
   that fits is kept (planned from the largest down).
3. The survivors are ranked by an estimate of their cost (FLOPs recomputed, precision, batch
   efficiency) and measured, best estimate first, in short real runs (`onegpu bench`'s row
   runner: fresh processes, median step time) until the time budget is spent.
4. The measured Pareto frontier (peak memory vs tokens/s) is printed and saved as tune.md,
   tune.json and tune.png; the winner is written as best.toml for `onegpu train --config`.

With `--world-size N` the search is for one of N processes under torchrun: the mesh (every
layout of N processes: DDP, FSDP, HSDP, tensor and pipeline parallelism and their products;
FSDP2 with its shards on the host) joins the candidates, the budget is the largest rank's
planned peak (`onegpu plan --world-size`), only what runs distributed is tried, and each trial
is a real `torchrun --nproc-per-node N` launch whose highest per-rank peak is reported. With
`--gpu NAME` and no GPU here the search is by prediction alone (plan/mesh_search.py).
"""

from __future__ import annotations

import itertools
import json
import tempfile
import time
from pathlib import Path
from typing import Any

from onegpu.config import (
    Config,
    ConfigError,
    ModelConfig,
    check_distributed,
    parse_checkpointing,
    resolve_strategy,
    with_overrides,
)
from onegpu.offload.weights import with_offload_params
from onegpu.perf.devices import cublas_workspace_bytes
from onegpu.perf.flops import recompute_factor
from onegpu.plan.budget import plan_budget
from onegpu.plan.memory import plan_memory
from onegpu.plan.mesh_search import largest_rank, layout_overrides, layouts
from onegpu.plan.targets import CUDA_OVERHEAD_BYTES, as_a_process_of, one_budget
from onegpu.techniques.precision import DeviceCaps, device_caps, resolve_precision
from onegpu.tools.tune_report import pareto, size_text, trial_label, write_results


def candidates(
    cfg: Config,
    device_type: str,
    with_compile: bool,
    world_size: int = 1,
    budget: str | None = None,
) -> list[dict[str, str]]:
    """Override sets to try, each a valid configuration (for `world_size` processes: one the
    distributed build accepts, its micro-batches splitting the global batch). `budget`: the
    checkpointing by budget to try beside the uniform policies (`budget:BYTES` of a measured
    search, `budget:auto` of a predicted one; one process only, as the build allows)."""
    batch = cfg.train.batch_size
    micro = sorted(
        {
            m
            for m in (1, 2, 4, 8, 16, 32, 64, 128, batch)
            if m * world_size <= batch and batch % (m * world_size) == 0
        }
    )
    lowp = precisions(target_caps(device_type))
    host_tiers = device_type == "cuda" and world_size == 1
    space = {
        "train.micro_batch_size": [str(m) for m in micro],
        "memory.checkpointing": ["none", "selective", "attn+mlp", "block"]
        + ([budget] if budget and world_size == 1 else []),
        "train.precision": lowp,
        # (APOLLO-Mini is in the fix list; on this axis its 0-byte lower bound keeps its
        # candidates from being pruned by arithmetic: 218 plans instead of 76 for an 8B)
        "optim.name": ["adamw", "adamw8bit", "adamw4bit"],
        "memory.loss_chunk": ["0", "1024"] if _vocab_size(cfg.model) > 4096 else ["0"],
        "memory.offload_activations": ["false", "true"] if device_type == "cuda" else ["false"],
        # the host tiers (one process; under torchrun FSDP's own CPU offload below)
        "memory.offload_optimizer": ["false", "true"] if host_tiers else ["false"],
        "memory.offload_states": ["false", "true"] if host_tiers else ["false"],
        "memory.offload_params": ["false", "true"] if host_tiers else ["false"],
        "train.compile": ["none", "regional"] if with_compile else ["none"],
    }
    meshes: list[dict[str, str]] = [{}]
    if world_size > 1:  # every layout: DDP, FSDP, HSDP, TP, PP and their products
        meshes = [layout_overrides(layout) for layout in layouts(world_size)]
        # host-resident shards cost a copy each way per step; worth it only where memory is short
        space["dist.cpu_offload"] = ["false", "true"] if device_type == "cuda" else ["false"]
    keys = list(space)
    out = []
    for values, mesh in itertools.product(itertools.product(*(space[k] for k in keys)), meshes):
        change = {**dict(zip(keys, values, strict=True)), **mesh}
        host = [change[f"memory.offload_{k}"] for k in ("params", "optimizer", "states")]
        if host.count("true") > 1:
            continue  # one home for the states: weights on the host take theirs with them
        try:
            changed = with_overrides(cfg, change)
            if world_size > 1:
                strategy = resolve_strategy(changed.dist, world_size, "--world-size")
                check_distributed(changed, strategy, world_size)
            elif changed.memory.offload_params:  # as the build runs it: FSDP2 over one process
                check_distributed(with_offload_params(changed), "fsdp", 1)
        except ConfigError:
            continue
        out.append(change)
    return out


def planned_peak(cfg: Config, target: str, world_size: int) -> int:
    """The planned peak of one process: the whole run, or the largest rank's of `world_size`
    (each pipeline stage's planned as itself)."""
    if world_size == 1:
        if parse_checkpointing(cfg.memory.checkpointing).kind == "budget":
            cfg, _ = plan_budget(cfg, target, None, None)  # the mix a run of it decides
        return plan_memory(cfg, target).memory["peak"]
    return largest_rank(cfg, target, None, world_size)[0]


def _vocab_size(m: ModelConfig) -> int:
    """The model's vocabulary (a model.hf folder's, not the preset's)."""
    if m.hf:
        from onegpu.models.hf import resolve_model_config

        return resolve_model_config(m).vocab_size
    return m.vocab_size


def target_caps(device_type: str) -> DeviceCaps:
    """What the tuned device runs natively: the device here, or for a GPU that is not here, a
    current one (bf16 and tf32)."""
    import torch

    if device_type == "cuda" and not torch.cuda.is_available():
        return DeviceCaps(
            "cuda", bf16=True, tf32=True, blas_workspace=cublas_workspace_bytes((9, 0))
        )
    return device_caps(torch.device(device_type))


def launch_line(world_size: int) -> str:
    """How best.toml is run: `onegpu train`, or under torchrun for several processes."""
    if world_size == 1:
        return "onegpu train"
    return f"torchrun --nproc-per-node {world_size} -m onegpu train"


def precisions(caps: DeviceCaps) -> list[str]:
    """The precisions worth trying: what `auto` picks there, and bf16-pure beside bf16."""
    auto = resolve_precision("auto", caps).name
    return [auto, "bf16-pure"] if auto == "bf16" else [auto]


def predicted_only(gpu: str | None, memory: int | None = None) -> bool:
    """Whether a search cannot measure: a GPU of the table was named and none is here (the
    search is then by prediction alone: tools/tune_plan.py)."""
    import torch

    from onegpu.perf.devices import known_gpu

    one_budget(gpu, memory)
    if gpu is None or torch.cuda.is_available():
        return False
    known_gpu(gpu)
    return True


def budget(gpu: str | None, memory: int | None) -> tuple[int, str]:
    """The memory budget and the target device kind: a GPU of the table (its memory less the
    CUDA overhead), `memory` bytes, or the GPU here; on a CPU `memory` is required."""
    import torch

    from onegpu.backends.torch.build import resolve_device
    from onegpu.perf.devices import GPUS, known_gpu

    one_budget(gpu, memory)
    target = "cuda" if resolve_device("auto").type == "cuda" else "cpu"
    if gpu is not None:
        known_gpu(gpu)
        return GPUS[gpu].memory_bytes - CUDA_OVERHEAD_BYTES, target
    if memory is not None:
        if memory <= 0:
            raise ConfigError("--memory", f"must be a positive number of bytes, got {memory}")
        return memory, target
    if target == "cuda":
        return torch.cuda.get_device_properties(0).total_memory - CUDA_OVERHEAD_BYTES, target
    raise ConfigError("--memory", "on a CPU give the budget in bytes, e.g. --memory 4000000000")


def estimated_cost(change: dict[str, str], batch: int) -> float:
    """Relative step time, for ordering the trials (lower first); not a prediction."""
    cost = recompute_factor(change["memory.checkpointing"])
    cost *= 1.0 if change["train.precision"].startswith("bf16") else 2.5
    cost *= 1.0 + 0.15 * (batch // int(change["train.micro_batch_size"]) - 1) ** 0.5
    cost *= {"adamw8bit": 1.03, "adamw4bit": 1.05, "apollo-mini": 1.05}.get(
        change["optim.name"], 1.0
    )
    cost *= 1.2 if change["memory.offload_activations"] == "true" else 1.0
    cost *= 1.5 if change["memory.offload_optimizer"] == "true" else 1.0
    cost *= 1.1 if change.get("memory.offload_states") == "true" else 1.0
    cost *= 2.0 if change["memory.offload_params"] == "true" else 1.0
    # FSDP gathers every block's weights twice a step (DDP: one all-reduce), offload adds copies
    cost *= 1.1 if change.get("dist.strategy") == "fsdp" else 1.0
    # tensor parallelism waits on its collectives, a pipeline on its bubble
    cost *= 1.25 if change.get("dist.tp", "1") != "1" else 1.0
    cost *= 1.3 if change.get("dist.pp", "1") != "1" else 1.0
    cost *= 1.3 if change.get("dist.cpu_offload") == "true" else 1.0
    return cost


def tune(
    cfg: Config,
    *,
    budget_bytes: int,
    target: str,
    time_budget_s: float,
    steps: int,
    out_dir: Path,
    preset: str | None,
    config_file: str | None,
    base_overrides: dict[str, str],
    with_compile: bool = False,
    world_size: int = 1,
    log=print,
) -> dict[str, Any]:
    t0 = time.perf_counter()
    cands = candidates(cfg, target, with_compile, world_size, budget=f"budget:{budget_bytes}")
    if not cands:
        raise ConfigError(
            "--world-size" if world_size > 1 else "train.batch_size",
            f"no configuration splits the global batch {cfg.train.batch_size} into "
            f"{world_size} process(es); use a multiple of {world_size}",
        )
    # on this CPU, planned with the threads each of the trials' processes runs with
    with as_a_process_of(world_size, target):
        planned, fitting = plan_candidates(cfg, cands, budget_bytes, target, world_size)
    log(
        f"tune: {len(cands)} candidates, {len(planned)} planned in "
        f"{time.perf_counter() - t0:.0f} s, {len(fitting)} to measure under {size_text(budget_bytes)}"
    )
    if not fitting:
        least = min(planned, key=lambda cp: cp[1])
        raise ConfigError(
            "--memory",
            f"nothing fits {budget_bytes:,} bytes: the leanest candidate "
            f"({', '.join(f'{k}={v}' for k, v in least[0].items())}) needs a planned "
            f"{least[1]:,} bytes; raise the budget or shrink the model, sequence or batch",
        )
    fitting.sort(key=lambda cp: (estimated_cost(cp[0], cfg.train.batch_size), cp[1]))
    run = {"preset": preset, "config_file": config_file, "steps": steps, "nproc": world_size}
    trials = measure(fitting, run, base_overrides, time_budget_s, log)
    best = max(trials, key=lambda r: r["tokens_per_s"])
    result = {
        "budget_bytes": budget_bytes,
        "world_size": world_size,
        "candidates": len(cands),
        "planned": len(planned),
        "fitting": len(fitting),
        "trials": trials,
        "frontier": pareto(trials),
        "best": best,
    }
    write_results(result, with_overrides(cfg, best["change"]), out_dir)
    return result


Planned = list[tuple[dict[str, str], int]]


def plan_candidates(
    cfg: Config, cands: list[dict[str, str]], budget_bytes: int, target: str, world_size: int
) -> tuple[Planned, Planned]:
    """(every candidate planned, those that fit). Per setting of everything else, only the
    largest micro-batch that fits is worth running (a smaller one only adds accumulation
    steps), and memory grows with the micro-batch: plan from the largest down and stop at the
    first that fits. Checkpointing by budget comes last, planned only where it can differ:
    where `none` does not fit and `block` does (or was not planned)."""
    groups: dict[str, list[dict[str, str]]] = {}
    for change in cands:
        rest = {k: v for k, v in change.items() if k != "train.micro_batch_size"}
        groups.setdefault(json.dumps(rest, sort_keys=True), []).append(change)
    by_budget = [g for g in groups.values() if _by_budget(g[0])]
    planned: Planned = []
    fitting: Planned = []
    for members in [g for g in groups.values() if not _by_budget(g[0])] + by_budget:
        seen = {_uniform_key(c, c["memory.checkpointing"]): peak for c, peak in planned}
        for change in sorted(members, key=lambda c: -int(c["train.micro_batch_size"])):
            if _by_budget(change):
                none = seen.get(_uniform_key(change, "none"))
                block = seen.get(_uniform_key(change, "block"))
                if none is not None and none <= budget_bytes:
                    break  # `none` fits here: the budget would choose it
                if block is not None and block > budget_bytes:
                    continue  # not even `block` fits: no mix does
            try:
                peak = planned_peak(with_overrides(cfg, change), target, world_size)
            except ConfigError:  # a technique this model cannot take (e.g. no GELU, no MLP)
                break
            planned.append((change, peak))
            if peak <= budget_bytes:
                fitting.append((change, peak))
                break
    return planned, fitting


def _by_budget(change: dict[str, str]) -> bool:
    return change["memory.checkpointing"].startswith("budget:")


def _uniform_key(change: dict[str, str], policy: str) -> str:
    """A candidate's settings with its checkpointing replaced by `policy`, as a lookup key."""
    return json.dumps({**change, "memory.checkpointing": policy}, sort_keys=True)


def _trained(res: dict[str, Any]) -> str:
    """', N trained' where the loss counts fewer tokens than the rows hold (masked prompts,
    padding): the figure instruction data is tuned for; every trial shares the data."""
    trained = res.get("trained_tokens_per_s")
    if not trained or trained >= 0.999 * res["tokens_per_s"]:
        return ""
    return f" ({trained:,.0f} trained)"


def measure(
    fitting: Planned, run: dict[str, Any], base: dict[str, str], time_budget_s: float, log
) -> list[dict[str, Any]]:
    """Short real runs of the fitting candidates, in order, until the time budget is spent
    (the budget is for measuring, not for planning; at least one runs)."""
    from onegpu.tools.bench import run_row

    trials = []
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as workdir:
        for change, peak in fitting:
            if trials and time.perf_counter() - t0 > time_budget_s:
                break
            res = run_row(
                run["preset"],
                run["config_file"],
                {**base, **change},
                run["steps"],
                Path(workdir),
                nproc=run["nproc"],
            )
            res.update(change=change, planned_peak_bytes=peak)
            trials.append(res)
            log(
                f"  {trial_label(change)}: {res['tokens_per_s']:,.0f} tokens/s"
                f"{_trained(res)}, planned {peak / 2**20:,.0f} MiB, measured "
                f"{res['peak_mem_bytes'] / 2**20:,.0f} MiB"
            )
    return trials
