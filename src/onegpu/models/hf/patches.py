"""The one place onegpu changes transformers' behaviour: a workaround, applied only around our
own forward calls (never process-wide), checked against transformers 4.56 to 5.23.

`transformers.masking_utils.find_packed_sequence_indices` looks at the position ids of every
forward to detect packed sequences (positions restarting inside a row). onegpu's rows are never
packed: positions are 0..T-1 in every row, so the answer is known ("not packed", None) without
running the check. Running it costs a host-device sync per forward on a GPU (it reads the
positions back with `.all()`), and on the planner's fake tensors it cannot run at all, so
transformers would take another path there (an explicit [B, 1, T, T] mask, grouped-query
key/value heads repeated) and the plan would not be the real step's.

tests/models/test_hf_patches.py fails when transformers renames or moves the function, stops
calling it, or starts answering something else than None for unpacked rows.
"""

from __future__ import annotations

import contextlib

import torch

PATCHED = "transformers.masking_utils.find_packed_sequence_indices"
CHECKED_WITH = ("4.56", "5.23")
"""The transformers versions this workaround was checked against."""


@contextlib.contextmanager
def never_packed():
    """Answer transformers' packed-sequence check with "not packed" inside the context."""
    import transformers.masking_utils as masking

    original = getattr(masking, "find_packed_sequence_indices", None)
    if original is None:  # pragma: no cover - a transformers without the check
        yield
        return
    masking.find_packed_sequence_indices = not_packed
    try:
        yield
    finally:
        masking.find_packed_sequence_indices = original


def not_packed(position_ids: torch.Tensor) -> None:
    """What the check answers for rows whose positions are 0..T-1: no packed sequences."""
    return None
