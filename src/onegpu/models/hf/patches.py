"""The one place onegpu changes transformers' behaviour: two workarounds, applied only around
our own forward calls (never process-wide), checked against transformers 4.56 to 5.23.

`transformers.masking_utils.find_packed_sequence_indices` looks at the position ids of every
forward to detect packed sequences (positions restarting inside a row). onegpu knows the answer
without running the check: rows of one document have positions 0..T-1 ("not packed", None),
and packed rows (`data.packing greedy|bfd`) have the document ids onegpu reads from their
positions by the same rule (models/documents.py). Running the check costs a host-device sync
per forward on a GPU (it reads the positions back with `.all()`), and on the planner's fake
tensors it cannot run at all, so transformers would take another path there (an explicit
[B, 1, T, T] mask, grouped-query key/value heads repeated) and the plan would not be the real
step's.

A mixture of experts' expert matmuls (`transformers.integrations.moe._grouped_mm`, behind
`torch._grouped_mm`) are not autocast ops: transformers casts the tokens to the weights' dtype,
so under bf16 autocast with fp32 master weights every expert matmul runs in fp32 (on a GPU the
slow per-expert fallback instead of the bf16 grouped kernel), and the fake-tensor shape rule of
`aten._grouped_mm` accepts bf16 only, so the planner could not follow an fp32 or autocast step
at all. `experts_in_compute_dtype` does what autocast does for a linear layer: under autocast,
tokens and weights are cast to the autocast dtype (the weight cast is differentiable: gradients
reach the fp32 masters); and on fake tensors in another dtype, transformers' own fallback
operator (which has a shape rule for every dtype, and the same saved tensors) stands in.
`experts_in_compute_dtype_always` puts the same patch around every call of a model's experts
modules too: a checkpointed block recomputes its experts in backward, outside the forward call,
where transformers' own function would recompute them in fp32 (torch refuses the mismatch with
the forward's bf16 tensors; on fake tensors the shape rule refuses fp32).

tests/models/test_hf_patches.py fails when transformers renames or moves either function,
stops calling it, or answers differently from the patch for what onegpu feeds it.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
from collections.abc import Callable, Iterator

import torch
from torch import nn

PATCHED = "transformers.masking_utils.find_packed_sequence_indices"
PATCHED_EXPERTS = "transformers.integrations.moe._grouped_mm"
CHECKED_WITH = ("4.56", "5.23")
"""The transformers versions this workaround was checked against."""


def never_packed() -> contextlib.AbstractContextManager:
    """Answer transformers' packed-sequence check with "not packed" inside the context."""
    return packed_as(None)


def packed_as(documents_BT: torch.Tensor | None) -> contextlib.AbstractContextManager:
    """Answer transformers' packed-sequence check with what onegpu knows inside the context:
    the rows' document ids, or None (one document a row)."""
    if documents_BT is None:
        answer = not_packed
    else:

        def answer(position_ids: torch.Tensor) -> torch.Tensor:
            return documents_BT

    return _swapped(
        "transformers.masking_utils", "find_packed_sequence_indices", lambda original: answer
    )


def not_packed(position_ids: torch.Tensor) -> None:
    """What the check answers for rows whose positions are 0..T-1: no packed sequences."""
    return None


@contextlib.contextmanager
def around_forward(documents_BT: torch.Tensor | None = None):
    """Every workaround, for the length of one forward call (`documents_BT`: packed rows'
    document ids, models/documents.py)."""
    with packed_as(documents_BT), experts_in_compute_dtype():
        yield


def experts_in_compute_dtype() -> contextlib.AbstractContextManager:
    """Expert matmuls in the autocast dtype under autocast, and plannable on fake tensors."""
    return _swapped("transformers.integrations.moe", "_grouped_mm", _in_compute_dtype)


def experts_in_compute_dtype_always(model: nn.Module) -> None:
    """Every experts module of `model` (a class transformers' `use_experts_implementation`
    made: its forward dispatches to the grouped matmuls) runs inside experts_in_compute_dtype
    wherever it is called: in the forward and in a checkpoint's recompute in backward. Under
    torch.compile the traced forward already holds the casts: nothing is swapped there."""
    for module in model.modules():
        if _dispatches_experts(type(module)):
            module.forward = _with_experts_patch(module.forward)


def _with_experts_patch(inner: Callable) -> Callable:
    @functools.wraps(inner)
    def forward(*args, **kwargs):
        if torch.compiler.is_compiling():
            return inner(*args, **kwargs)
        with experts_in_compute_dtype():
            return inner(*args, **kwargs)

    return forward


def _dispatches_experts(cls: type) -> bool:
    try:
        moe = importlib.import_module("transformers.integrations.moe")
    except ImportError:  # pragma: no cover - transformers 4.x has no grouped experts
        return False
    code = getattr(getattr(cls, "forward", None), "__code__", None)
    return code is not None and code.co_filename == moe.__file__


def _in_compute_dtype(original: Callable) -> Callable:
    def grouped_mm(input: torch.Tensor, weight: torch.Tensor, offs: torch.Tensor):
        device = input.device.type
        dtype = weight.dtype
        if torch.is_autocast_enabled(device):
            dtype = torch.get_autocast_dtype(device)
        input, weight = input.to(dtype), weight.to(dtype)
        if dtype != torch.bfloat16 and _is_fake(weight):
            return torch.ops.transformers.grouped_mm_fallback(input, weight, offs=offs)
        return original(input, weight, offs)

    grouped_mm.patched = True  # type: ignore[attr-defined]
    return grouped_mm


@contextlib.contextmanager
def _swapped(module: str, name: str, replacement: Callable[[Callable], Callable]) -> Iterator[None]:
    """`module.name` replaced by `replacement(original)` inside the context; nothing changed
    where this transformers lacks the module or the function (older versions)."""
    try:
        found = importlib.import_module(module)
    except ImportError:  # pragma: no cover - transformers 4.x has no grouped experts
        found = None
    original = getattr(found, name, None)
    if original is None or getattr(original, "patched", False):  # none, or swapped already
        yield
        return
    setattr(found, name, replacement(original))
    try:
        yield
    finally:
        setattr(found, name, original)


def _is_fake(t: torch.Tensor) -> bool:
    from torch._subclasses.fake_tensor import is_fake

    return is_fake(t)
