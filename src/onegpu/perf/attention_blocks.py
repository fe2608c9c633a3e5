"""The query blocks of `blocked` attention (models/blocked_attention.py) and the bytes they
save: shapes only, shared by the kernel, `auto`'s memory rule and the planner's estimates."""

from __future__ import annotations

MAX_BLOCKS = 4
"""Query blocks per head: more skip more masked products, smaller ones run below peak."""
MIN_ROWS = 128
"""Smallest query block: below it the batched matmuls fall off the machine's peak."""


def query_blocks(T: int) -> list[tuple[int, int]]:
    """[(start, end)] row ranges of the query blocks of a length-T sequence."""
    n = max(1, min(MAX_BLOCKS, T // MIN_ROWS))
    bounds = [round(i * T / n) for i in range(n + 1)]
    return list(zip(bounds[:-1], bounds[1:], strict=True))


def saved_prob_bytes(B: int, H: int, T: int, itemsize: int) -> int:
    """Bytes of the probabilities one layer saves for backward (rows x the keys each sees)."""
    return B * H * sum((end - start) * end for start, end in query_blocks(T)) * itemsize
