"""The training and validation windows and their order, in numpy: one definition for both
backends, so that a torch run and a JAX run of the same config see the same batches.

Window i is tokens[i*T : i*T + T + 1] (inputs, then targets shifted by one). The order is a
fresh permutation per epoch, fixed by (seed, epoch), and a position is a sample index, so a
resumed run continues exactly where it stopped.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np

IGNORE_INDEX = -100
"""The target of a position that is not trained (torch's cross_entropy default; the JAX loss
uses the same): one value for both backends."""


def window_count(n_tokens: int, seq_len: int) -> int:
    return max(0, (n_tokens - 1) // seq_len)


def window(tokens: np.ndarray, i: int, seq_len: int) -> np.ndarray:
    """Window i as int64: T + 1 tokens (inputs [:-1], targets [1:])."""
    start = i * seq_len
    return tokens[start : start + seq_len + 1].astype(np.int64)


def epoch_order(n: int, seed: int, epoch: int) -> np.ndarray:
    """Epoch `epoch`'s permutation of the n windows (numpy's PCG64: the same on every machine)."""
    return np.random.Generator(np.random.PCG64(seed * 1_000_003 + epoch)).permutation(n)


def sample_indices(n: int, seed: int, start: int = 0) -> Iterator[int]:
    """Endless window indices from sample number `start` on."""
    epoch, offset = divmod(start, n)
    while True:
        yield from epoch_order(n, seed, epoch)[offset:].tolist()
        epoch, offset = epoch + 1, 0


def train_windows(
    tokens: np.ndarray, *, seq_len: int, batch_size: int, seed: int, start: int = 0
) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """Endless (inputs, targets) batches of [batch_size, seq_len] int64, after `start` samples."""
    indices = sample_indices(window_count(len(tokens), seq_len), seed, start)
    while True:
        rows = np.stack([window(tokens, next(indices), seq_len) for _ in range(batch_size)])
        yield rows[:, :-1], rows[:, 1:]


def eval_windows(
    tokens: np.ndarray, *, seq_len: int, batch_size: int, n_batches: int
) -> list[tuple[np.ndarray, np.ndarray]]:
    """The first n_batches batches of the validation split: the same every evaluation."""
    n = min(window_count(len(tokens), seq_len), batch_size * n_batches)
    out = []
    for s in range(0, n, batch_size):
        rows = np.stack([window(tokens, i, seq_len) for i in range(s, min(s + batch_size, n))])
        out.append((rows[:, :-1], rows[:, 1:]))
    return out
