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
