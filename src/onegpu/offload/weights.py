"""Weights in host memory (`memory.offload_params`): FSDP2 with its shards on the host, one
process (or each process of a torchrun job), whose optimizer then steps on the host too. The
build applies it (backends/torch/build.py), so every command that builds gets it; the planner
plans the same rewrite."""

from __future__ import annotations

import dataclasses

from onegpu.config import Config


def with_offload_params(cfg: Config) -> Config:
    """memory.offload_params as what runs it: FSDP2's CPU offload (idempotent)."""
    if not cfg.memory.offload_params:
        return cfg
    return dataclasses.replace(
        cfg,
        dist=dataclasses.replace(cfg.dist, strategy="fsdp", cpu_offload=True),
        memory=dataclasses.replace(cfg.memory, offload_optimizer=False),
    )
