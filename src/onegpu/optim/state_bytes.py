"""Bytes held by an optimizer's state, counting quantized (tensor-subclass) states exactly."""

from __future__ import annotations

import torch


def tensor_bytes(t: torch.Tensor) -> int:
    """Storage bytes of a tensor; for a tensor subclass (e.g. torchao's 8-bit states), the sum
    of its inner tensors (codes and scales), which is what it really occupies."""
    if hasattr(t, "__tensor_flatten__") and type(t) is not torch.Tensor:
        names, _ = t.__tensor_flatten__()
        return sum(tensor_bytes(getattr(t, n)) for n in names)
    return t.numel() * t.element_size()


def optimizer_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    return sum(
        tensor_bytes(v)
        for state in optimizer.state.values()
        for v in state.values()
        if isinstance(v, torch.Tensor)
    )
