"""The training and validation rows and their order, in numpy: one definition for both
backends, so that a torch run and a JAX run of the same config see the same batches.

A split becomes rows of T inputs and T targets in one of two ways (`data.packing`):
- `stream`: the token stream cut into windows, row i = tokens[i*T : i*T + T + 1] (inputs, then
  targets shifted by one), across example boundaries: no token is wasted, and an example can
  attend to the one before it (pre-training on text, as nanoGPT does);
- `none`: one example per row from its first token, padded to T: causal attention never lets an
  example see the padding after it, so each row trains exactly as the example would alone; the
  padding's targets are IGNORE_INDEX. Examples longer than T + 1 tokens are truncated or
  dropped (`data.overlong`), and counted.

The order is a fresh permutation per epoch, fixed by (seed, epoch), and a position is a sample
index, so a resumed run continues exactly where it stopped.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np

IGNORE_INDEX = -100
"""The target of a position that is not trained (torch's cross_entropy default; the JAX loss
uses the same): one value for both backends."""
PAD_ID = 0
"""The input id after a row's example (never attended to by it; its targets are ignored)."""


def window_count(n_tokens: int, seq_len: int) -> int:
    return max(0, (n_tokens - 1) // seq_len)


def window(tokens: np.ndarray, i: int, seq_len: int) -> np.ndarray:
    """Window i as int64: T + 1 tokens (inputs [:-1], targets [1:])."""
    start = i * seq_len
    return tokens[start : start + seq_len + 1].astype(np.int64)


@dataclass(frozen=True)
class Rows:
    """A split cut into rows of `seq_len` inputs and targets. `spans` ([N, 2] start, end):
    one example per row (packing `none`); None: windows of the stream. `stats`: what padding
    and over-long examples cost (packing `none`)."""

    tokens: np.ndarray
    seq_len: int
    mask: np.ndarray | None = None
    spans: np.ndarray | None = None
    stats: dict[str, float] = field(default_factory=dict)

    def __len__(self) -> int:
        if self.spans is None:
            return window_count(len(self.tokens), self.seq_len)
        return len(self.spans)

    def window(self, i: int) -> np.ndarray:
        """Row i's T + 1 tokens of the stream (packing `stream` only: a classifier's rows)."""
        return window(self.tokens, i, self.seq_len)

    def pair(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        """Row i as (inputs, targets) of T int64 each; targets a mask leaves untrained (a
        prompt, a user's turn) or padding are IGNORE_INDEX."""
        T = self.seq_len
        start, end = (i * T, i * T + T + 1) if self.spans is None else self.spans[i]
        ids = self.tokens[start:end].astype(np.int64)
        inputs = np.full(T, PAD_ID, dtype=np.int64)
        targets = np.full(T, IGNORE_INDEX, dtype=np.int64)
        n = len(ids) - 1
        inputs[:n], targets[:n] = ids[:-1], ids[1:]
        if self.mask is not None:
            targets[:n][self.mask[start + 1 : end] == 0] = IGNORE_INDEX
        return inputs, targets


def example_rows(
    tokens: np.ndarray,
    starts: np.ndarray,
    seq_len: int,
    *,
    mask: np.ndarray | None = None,
    drop_overlong: bool = False,
) -> Rows:
    """One example per row (packing `none`): examples longer than T + 1 tokens keep their
    first T + 1 (or are dropped); the rows' padding share and the tokens lost are counted."""
    starts = np.asarray(starts, dtype=np.int64)
    ends = np.append(starts[1:], len(tokens)).astype(np.int64)
    lengths = ends - starts
    over = lengths > seq_len + 1
    keep = ~over if drop_overlong else np.ones(len(starts), dtype=bool)
    kept_ends = np.minimum(ends, starts + seq_len + 1)[keep]
    spans = np.stack([starts[keep], kept_ends], axis=1)
    used = int((kept_ends - starts[keep] - 1).clip(min=0).sum())
    stats = {
        "examples": int(keep.sum()),
        "overlong": int(over.sum()),
        "dropped": int((~keep).sum()),
        "tokens_lost": int(
            np.where(keep, lengths - np.minimum(lengths, seq_len + 1), lengths).sum()
        ),
        "padding": 1.0 - used / max(1, len(spans) * seq_len),
    }
    return Rows(tokens, seq_len, mask, spans, stats)


def epoch_order(n: int, seed: int, epoch: int) -> np.ndarray:
    """Epoch `epoch`'s permutation of the n rows (numpy's PCG64: the same on every machine)."""
    return np.random.Generator(np.random.PCG64(seed * 1_000_003 + epoch)).permutation(n)


def sample_indices(n: int, seed: int, start: int = 0) -> Iterator[int]:
    """Endless row indices from sample number `start` on."""
    epoch, offset = divmod(start, n)
    while True:
        yield from epoch_order(n, seed, epoch)[offset:].tolist()
        epoch, offset = epoch + 1, 0


def _batch(rows: Rows, indices: list[int]) -> tuple[np.ndarray, np.ndarray]:
    pairs = [rows.pair(i) for i in indices]
    return np.stack([x for x, _ in pairs]), np.stack([y for _, y in pairs])


def train_windows(
    rows: Rows, *, batch_size: int, seed: int, start: int = 0
) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """Endless (inputs, targets) batches of [batch_size, seq_len] int64, after `start` samples."""
    indices = sample_indices(len(rows), seed, start)
    while True:
        yield _batch(rows, [next(indices) for _ in range(batch_size)])


def eval_windows(
    rows: Rows, *, batch_size: int, n_batches: int
) -> list[tuple[np.ndarray, np.ndarray]]:
    """The first n_batches batches of the validation split: the same every evaluation."""
    n = min(len(rows), batch_size * n_batches)
    return [_batch(rows, list(range(s, min(s + batch_size, n)))) for s in range(0, n, batch_size)]
