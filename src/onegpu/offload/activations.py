"""Activation offloading: tensors saved for backward wait in host memory, not on the device.

PyTorch's `save_on_cpu` copies each saved tensor to (pinned, on CUDA) host memory in forward and
back in backward. Non-reentrant checkpointing saves its inputs through the same hooks, so with
checkpointing on, exactly the checkpoints that remain are offloaded (the combination Gusak's survey recommends).
On a CPU device the "copy to host" is a copy within host memory: correct, and no saving.
"""

from __future__ import annotations

import functools

import torch

from onegpu.models.protocol import LossFn


def saved_to_host(pin: bool):
    """The saved-tensor hooks that move what backward needs to host memory (looked up at each
    call, so the planner can follow the copies as host bytes: plan/memory.py)."""
    return torch.autograd.graph.save_on_cpu(pin_memory=pin)


def with_offload(loss_fn: LossFn, device: torch.device) -> LossFn:
    pin = device.type == "cuda"

    @functools.wraps(loss_fn)
    def offloaded(model, idx, targets):
        with saved_to_host(pin):
            return loss_fn(model, idx, targets)

    offloaded.saves_on_host = True  # what offload/homes.py reads
    return offloaded
