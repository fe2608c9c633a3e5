"""Which examples share a row: bin packing of example lengths into rows of `capacity` positions.

- `greedy` (next fit): examples in their order, a new row whenever the next one does not fit;
  fast and order-preserving, and it wastes at most the longest example per row.
- `bfd` (best-fit decreasing): the longest example first, each into the fullest row it still
  fits; within 11/9 of the fewest rows possible (Johnson, 1973), TRL's default.

Lengths are what an example occupies in a row: its tokens less one (a row holds inputs and the
targets shifted by one within the example), at most `capacity`. The result is the example
indices row after row and where each row's start in them (`offsets`, one more than rows).
"""

from __future__ import annotations

import bisect

import numpy as np


def next_fit(lengths: np.ndarray, capacity: int) -> tuple[np.ndarray, np.ndarray]:
    """Greedy packing: examples in their order, a new row when the next one overflows."""
    lengths = np.asarray(lengths, dtype=np.int64)
    _check(lengths, capacity)
    # a row starts where the running sum since the row's start would pass the capacity
    starts = [0]
    filled = 0
    for i, n in enumerate(lengths.tolist()):
        if filled + n > capacity:
            starts.append(i)
            filled = 0
        filled += n
    offsets = np.array([*starts, len(lengths)] if len(lengths) else [0], dtype=np.int64)
    return np.arange(len(lengths), dtype=np.int64), offsets


def best_fit_decreasing(lengths: np.ndarray, capacity: int) -> tuple[np.ndarray, np.ndarray]:
    """Best-fit decreasing: longest first, each into the row with the least room that fits
    it (a sorted list of (room, row): O(n log n) searches)."""
    lengths = np.asarray(lengths, dtype=np.int64)
    _check(lengths, capacity)
    order = np.argsort(-lengths, kind="stable")
    shortest = int(lengths.min()) if len(lengths) else 0
    rows: list[list[int]] = []
    rooms: list[tuple[int, int]] = []  # (room left, row), sorted; rows too full to take
    # even the shortest example leave the list, which keeps its insertions short
    for i in order.tolist():
        n = int(lengths[i])
        at = bisect.bisect_left(rooms, (n, -1))
        if at == len(rooms):
            rows.append([i])
            room, row = capacity, len(rows) - 1
        else:
            room, row = rooms.pop(at)
            rows[row].append(i)
        if room - n >= max(shortest, 1):
            bisect.insort(rooms, (room - n, row))
    sizes = [len(r) for r in rows]
    indices = np.array([i for r in rows for i in r], dtype=np.int64)
    return indices, np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)


def one_per_row(lengths: np.ndarray, capacity: int) -> tuple[np.ndarray, np.ndarray]:
    """No packing: each example a row of its own."""
    n = len(lengths)
    return np.arange(n, dtype=np.int64), np.arange(n + 1, dtype=np.int64)


PACKERS = {"none": one_per_row, "greedy": next_fit, "bfd": best_fit_decreasing}


def _check(lengths: np.ndarray, capacity: int) -> None:
    if len(lengths) and int(lengths.max()) > capacity:
        raise ValueError(f"an example of {int(lengths.max())} positions exceeds {capacity}")
