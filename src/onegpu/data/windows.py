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


def pair(
    tokens: np.ndarray, mask: np.ndarray | None, i: int, seq_len: int
) -> tuple[np.ndarray, np.ndarray]:
    """Window i as (inputs, targets) of T int64 each; targets a mask leaves untrained (a
    prompt, a user's turn) are IGNORE_INDEX."""
    w = window(tokens, i, seq_len)
    inputs, targets = w[:-1], w[1:].copy()
    if mask is not None:
        start = i * seq_len + 1
        targets[mask[start : start + seq_len] == 0] = IGNORE_INDEX
    return inputs, targets


def epoch_order(n: int, seed: int, epoch: int) -> np.ndarray:
    """Epoch `epoch`'s permutation of the n windows (numpy's PCG64: the same on every machine)."""
    return np.random.Generator(np.random.PCG64(seed * 1_000_003 + epoch)).permutation(n)


def sample_indices(n: int, seed: int, start: int = 0) -> Iterator[int]:
    """Endless window indices from sample number `start` on."""
    epoch, offset = divmod(start, n)
    while True:
        yield from epoch_order(n, seed, epoch)[offset:].tolist()
        epoch, offset = epoch + 1, 0


def _batch(
    tokens: np.ndarray, mask: np.ndarray | None, indices: list[int], seq_len: int
) -> tuple[np.ndarray, np.ndarray]:
    pairs = [pair(tokens, mask, i, seq_len) for i in indices]
    return np.stack([x for x, _ in pairs]), np.stack([y for _, y in pairs])


def train_windows(
    tokens: np.ndarray,
    *,
    seq_len: int,
    batch_size: int,
    seed: int,
    start: int = 0,
    mask: np.ndarray | None = None,
) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """Endless (inputs, targets) batches of [batch_size, seq_len] int64, after `start` samples."""
    indices = sample_indices(window_count(len(tokens), seq_len), seed, start)
    while True:
        yield _batch(tokens, mask, [next(indices) for _ in range(batch_size)], seq_len)


def eval_windows(
    tokens: np.ndarray,
    *,
    seq_len: int,
    batch_size: int,
    n_batches: int,
    mask: np.ndarray | None = None,
) -> list[tuple[np.ndarray, np.ndarray]]:
    """The first n_batches batches of the validation split: the same every evaluation."""
    n = min(window_count(len(tokens), seq_len), batch_size * n_batches)
    return [
        _batch(tokens, mask, list(range(s, min(s + batch_size, n))), seq_len)
        for s in range(0, n, batch_size)
    ]
