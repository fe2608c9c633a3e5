"""The configured step's matmul floor on its device (perf/floor.py): its products traced on
fake tensors (no compute, any model the planner can follow), each timed alone here."""

from __future__ import annotations

import dataclasses

import torch

from onegpu.backends.torch.build import build
from onegpu.backends.torch.loader import placeholder_batch
from onegpu.config import Config
from onegpu.perf.floor import Floor, Gemm, GemmRecorder, matmul_floor
from onegpu.techniques import bias_epilogue
from onegpu.techniques.precision import device_caps


def micro_batch_gemms(cfg: Config, device: torch.device) -> list[Gemm]:
    """The matrix products of one micro-batch's forward and backward (and of the optimizer
    step, which has none) of `cfg` on `device`, as dispatched."""
    t = cfg.train
    one = dataclasses.replace(
        cfg,
        train=dataclasses.replace(t, batch_size=t.micro_batch_size, max_steps=2),
        # where bytes live changes no product: traced as one plain process (weight offload
        # is FSDP2 on a group of one, which a second build from its rewritten config refuses)
        memory=dataclasses.replace(
            cfg.memory, offload_params=False, offload_optimizer=False, offload_activations=False
        ),
        dist=dataclasses.replace(cfg.dist, strategy="none", cpu_offload=False),
    )
    caps = device_caps(device) if device.type == "cpu" else None
    built = build(one, device, with_data=False, caps=caps, fake=True)
    recorder = GemmRecorder()
    with built.fake_mode:
        x, y = placeholder_batch(t.micro_batch_size, cfg.train_seq_len, built.classes)
        with recorder:
            built.step(x, y, y.numel(), 0)
    return recorder.gemms


def step_floor(cfg: Config, device: torch.device, *, refresh: bool = False) -> Floor:
    """The floor of one optimizer step: a micro-batch's products times the micro-batches
    (`refresh`: timed again, not read from the cache)."""
    gemms = micro_batch_gemms(cfg, device)
    repeat = cfg.grad_accum_steps
    return matmul_floor(gemms, device, repeat, refresh=refresh, runs_as=bias_epilogue.runs_as)


def checked_floor(cfg: Config, device: torch.device, step_s: float | None) -> Floor:
    """`step_floor`, timed again once where it exceeds the measured step: a floor above the
    step it bounds was timed while something else ran (on 2 busy cores a small product's
    threads wait on each other), and the cache would keep it for every later run."""
    floor = step_floor(cfg, device)
    if step_s is not None and floor.seconds > step_s:
        floor = step_floor(cfg, device, refresh=True)
    return floor
