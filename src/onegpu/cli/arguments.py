"""Arguments more than one subcommand takes, and the shorthand that declares them."""

from __future__ import annotations

from typing import Any

from onegpu.plan.links import INTERCONNECTS

Arg = tuple[tuple[str, ...], dict[str, Any]]
"""An argparse argument: its flags and keyword arguments."""


def _a(*flags: str, **kwargs: Any) -> Arg:
    return flags, kwargs


WORLD_SIZE = _a(
    "--world-size",
    type=int,
    default=1,
    metavar="N",
    help="plan one of N processes under torchrun (--dist.strategy fsdp|ddp, or a mesh of "
    "--dist.dp_replicate/dp_shard/tp/pp; auto: fsdp)",
)
HOST_MEMORY = _a(
    "--host-memory",
    type=int,
    metavar="BYTES",
    help="host memory for offloaded state (default: this machine's RAM)",
)
HOST_CPUS = _a(
    "--host-cpus",
    type=int,
    metavar="N",
    help="price a step on the host CPU (memory.offload_optimizer, offload_params) for N "
    "cores, scaled from this machine's measured rate (default: this machine's)",
)
GRID_HELP = (
    "all, or a comma-separated list of: hf-guide (HF's single-GPU guide on the GPT), "
    "hf-guide-bert (the guide's rows on a scaled-down BERT classifier, as the guide "
    "measured), lippe (Lippe's profiling tutorial), training-loop (Optimising the "
    "Training Loop); former names hf, hf-bert, seed000, seed003 still work"
)
INTERCONNECT = _a(
    "--interconnect",
    choices=sorted(INTERCONNECTS),
    default="nvlink",
    help="the link between the GPUs of a mesh (--dist.tp/pp/dp_*): what each dimension's "
    "sends cost (default nvlink)",
)

PLAN_ARGS = (
    _a(
        "--gpu",
        help="a GPU of the table (e.g. A100-40, RTX4090, h200: any case, the model alone "
        "where the table has one size of it), or 'list'",
    ),
    _a(
        "--memory",
        type=int,
        help="a memory budget in bytes (e.g. this machine's RAM); with --gpu, the "
        "bytes of tensors allowed on that GPU (below its memory)",
    ),
    _a("--json", action="store_true", help="print one JSON object"),
    HOST_MEMORY,
    _a(
        "--largest",
        action="store_true",
        help="the largest model of the configured one's family (depth and width "
        "scaled together) that trains in full on --gpu / --memory, and how",
    ),
    _a(
        "--best-toml",
        metavar="PATH",
        help="where the fix list finds a configuration that fits: write it here",
    ),
    WORLD_SIZE,
    INTERCONNECT,
    HOST_CPUS,
)

TUNE_ARGS = (
    _a("--gpu", help="budget: a GPU of the table (onegpu plan --gpu list)"),
    _a("--memory", type=int, help="budget in bytes (on a CPU: required)"),
    _a(
        "--time-budget",
        type=float,
        default=300,
        help="seconds of measured trials (default: 300)",
    ),
    _a("--steps", type=int, default=6, help="steps per trial (default: 6)"),
    _a("--with-compile", action="store_true", help="also try regional compile"),
    HOST_MEMORY,
    _a(
        "--world-size",
        type=int,
        default=1,
        metavar="N",
        help="tune one of N processes under torchrun: the mesh (DDP, FSDP, HSDP, TP, PP "
        "and their products) joins the search, the budget is per process; trials launch "
        "N processes (with --gpu and no GPU here: predicted, not measured)",
    ),
    INTERCONNECT,
    HOST_CPUS,
)
