"""Bytes held by an optimizer's state, counting quantized (tensor-subclass) states exactly."""

from __future__ import annotations

import torch


def tensor_bytes(t: torch.Tensor) -> int:
    """Storage bytes of a tensor; for a tensor subclass (e.g. torchao's 8-bit states), the sum
    of its inner tensors (codes and scales), which is what it really occupies; for a sharded
    tensor (FSDP's DTensor), this process's shard."""
    if hasattr(t, "to_local"):
        t = t.to_local()
    if hasattr(t, "__tensor_flatten__") and type(t) is not torch.Tensor:
        names, _ = t.__tensor_flatten__()
        return sum(tensor_bytes(getattr(t, n)) for n in names)
    return t.numel() * t.element_size()


def optimizer_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    return sum(
        tensor_bytes(t)
        for state in optimizer.state.values()
        for v in state.values()
        for t in _state_tensors(v)
    )


def _state_tensors(value: object) -> tuple[torch.Tensor, ...]:
    """The tensors a state entry holds: itself, or a low-rank projector's matrices (an object
    in GaLore's and APOLLO's state, optim/low_rank.py)."""
    if isinstance(value, torch.Tensor):
        return (value,)
    matrix = getattr(value, "ortho_matrix", None)
    if matrix is None:
        return ()
    return tuple(matrix) if isinstance(matrix, tuple) else (matrix,)


def state_bytes_per_param(optimizer: str) -> float:
    """At least this many bytes of optimizer state per parameter (searches' lower bounds)."""
    per_param = {"adamw": 8.0, "adam": 8.0, "lamb": 8.0, "lars": 4.0, "adamw8bit": 2.0}
    return {**per_param, "adamw4bit": 1.0}.get(optimizer, 0.0)


QMAP_BYTES = 256 * 4  # torchao keeps its 256-entry fp32 code book with every 8-bit state


def predicted_state_bytes(name: str, params: list[torch.Tensor], block_size: int = 256) -> int:
    """State bytes of optimizers whose step cannot run on fake tensors (Adafactor reads a
    scalar back with .item(); torchao's 8-bit step is compiled), from their own allocation rules.
    Checked against real optimizers in the tests."""
    total = 0
    for p in params:
        if name == "adafactor":  # torch.optim.Adafactor._init_group
            total += 4  # fp32 step counter
            if p.dim() > 1:
                rows = p.numel() // p.shape[-1]
                cols = p.numel() // p.shape[-2]
                total += (rows + cols) * p.element_size()
            else:
                total += p.numel() * p.element_size()
        elif name == "adamw8bit":  # torchao _AdamBase._new_buffer, two moments
            total += 4  # fp32 step counter
            if p.numel() >= 4096 and p.numel() % block_size == 0:
                total += 2 * (p.numel() + p.numel() // block_size * 4 + QMAP_BYTES)
            else:
                total += 2 * p.numel() * p.element_size()
        elif name == "adamw4bit":  # torchao: two 4-bit codes a byte, a scale per 128, 16 codes
            total += 4
            if p.numel() >= 4096 and p.numel() % 128 == 0:
                total += 2 * (p.numel() // 2 + p.numel() // 128 * 4 + 16 * 4)
            else:
                total += 2 * p.numel() * p.element_size()
        elif name == "lamb":  # pytorch-optimizer: two moments, and the step's three norms kept
            total += (2 * p.numel() + 3) * p.element_size()
        elif name == "lars":  # pytorch-optimizer: a momentum buffer
            total += p.numel() * p.element_size()
        else:
            raise ValueError(f"no allocation rule for {name!r}")
    return total


STEP_TRANSIENT_BYTES = {"adamw8bit": 8, "adamw4bit": 26}
"""Bytes per element of the largest parameter that torchao's low-bit step holds at once on a
CPU (measured under fp32, bf16 and bf16-pure alike: the 8-bit step dequantizes both moments
to fp32; the 4-bit step about six fp32 copies of the parameter). It steps one parameter at a
time, so the largest one sets the peak. GPU plans use the same figures until a GPU measures
them (the one H100 run held more than the planner then counted: docs/offload.md)."""


def step_transient_bytes(name: str, params: list[torch.Tensor]) -> int:
    """What the step of an optimizer the planner cannot run holds beyond its states."""
    per_element = STEP_TRANSIENT_BYTES.get(name, 0)
    return per_element * max((p.numel() for p in params), default=0)
