"""The training and validation rows and their order, in numpy: one definition for both
backends, so that a torch run and a JAX run of the same config see the same batches.

A split becomes rows of T inputs and T targets in one of three ways (`data.packing`):
- `stream`: the token stream cut into windows, row i = tokens[i*T : i*T + T + 1] (inputs, then
  targets shifted by one), across example boundaries: no token is wasted, and an example can
  attend to the one before it (pre-training on text, as nanoGPT does);
- `none`: one example per row from its first token, padded to T: causal attention never lets an
  example see the padding after it, so each row trains exactly as the example would alone;
- `greedy` or `bfd`: several examples a row (data/packing.py), each with positions from 0, and
  the model attends only within each (a block-diagonal causal mask): each example trains
  exactly as it would alone, with far less padding than `none`.
Padding's targets are IGNORE_INDEX. Examples longer than `data.max_len` tokens (at most the
row's T + 1) are truncated or dropped (`data.overlong`), and counted.

The order is a fresh permutation per epoch, fixed by (seed, epoch), and a position is a sample
index, so a resumed run continues exactly where it stopped.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np

from onegpu.data.packing import PACKERS

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
    """A split cut into rows of `seq_len` inputs and targets: windows of the stream (`spans`
    None), or examples (`spans`: [N, 2] start, end of each kept example) placed in rows as
    `packs[offsets[r]:offsets[r + 1]]` says (data/packing.py). `isolated`: several examples
    share a row, each with positions from 0 (`positions`), and the model attends only within
    each. `stats`: what padding and over-long examples cost (examples only)."""

    tokens: np.ndarray
    seq_len: int
    mask: np.ndarray | None = None
    spans: np.ndarray | None = None
    packs: np.ndarray | None = None
    offsets: np.ndarray | None = None
    isolated: bool = False
    stats: dict[str, float] = field(default_factory=dict)

    def __len__(self) -> int:
        if self.offsets is None:
            return window_count(len(self.tokens), self.seq_len)
        return len(self.offsets) - 1

    def window(self, i: int) -> np.ndarray:
        """Row i's T + 1 tokens of the stream (packing `stream` only: a classifier's rows)."""
        return window(self.tokens, i, self.seq_len)

    def pair(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        """Row i as (inputs, targets) of T int64 each; targets a mask leaves untrained (a
        prompt, a user's turn) or padding are IGNORE_INDEX."""
        inputs, targets, _ = self.row(i)
        return inputs, targets

    def row(self, i: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Row i as (inputs, targets, positions) of T int64 each: each example's inputs and
        targets shifted by one within it, from position 0; the padding after the last one a
        document of its own (never attended to by an example: its targets are ignored)."""
        T = self.seq_len
        if self.spans is None:
            return self._placed([(i * T, i * T + T + 1)])
        assert self.packs is not None and self.offsets is not None
        examples = self.packs[self.offsets[i] : self.offsets[i + 1]]
        return self._placed(self.spans[examples].tolist())

    def _placed(self, spans: list) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        T = self.seq_len
        inputs = np.full(T, PAD_ID, dtype=np.int64)
        targets = np.full(T, IGNORE_INDEX, dtype=np.int64)
        positions = np.empty(T, dtype=np.int64)
        at = 0
        for start, end in spans:
            ids = self.tokens[start:end].astype(np.int64)
            n = len(ids) - 1
            inputs[at : at + n], targets[at : at + n] = ids[:-1], ids[1:]
            if self.mask is not None:
                targets[at : at + n][self.mask[start + 1 : end] == 0] = IGNORE_INDEX
            positions[at : at + n] = np.arange(n)
            at += max(n, 0)
        positions[at:] = np.arange(T - at)
        return inputs, targets, positions


def example_rows(
    tokens: np.ndarray,
    starts: np.ndarray,
    seq_len: int,
    *,
    mask: np.ndarray | None = None,
    packing: str = "none",
    max_len: int = 0,
    drop_overlong: bool = False,
) -> Rows:
    """Examples into rows (`packing` none: one a row; greedy or bfd: packed, isolated).
    Examples longer than `max_len` tokens (0: the row, T + 1) keep their first `max_len` (or
    are dropped); the rows' padding share and the tokens lost are counted."""
    limit = max_len or seq_len + 1
    starts = np.asarray(starts, dtype=np.int64)
    ends = np.append(starts[1:], len(tokens)).astype(np.int64)
    lengths = ends - starts
    over = lengths > limit
    keep = ~over if drop_overlong else np.ones(len(starts), dtype=bool)
    kept_ends = np.minimum(ends, starts + limit)[keep]
    spans = np.stack([starts[keep], kept_ends], axis=1)
    occupied = (kept_ends - starts[keep] - 1).clip(min=0)
    packs, offsets = PACKERS[packing](occupied, seq_len)
    rows = len(offsets) - 1
    stats = {
        "examples": int(keep.sum()),
        "rows": rows,
        "overlong": int(over.sum()),
        "dropped": int((~keep).sum()),
        "tokens_lost": int(np.where(keep, lengths - np.minimum(lengths, limit), lengths).sum()),
        "padding": 1.0 - int(occupied.sum()) / max(1, rows * seq_len),
    }
    return Rows(tokens, seq_len, mask, spans, packs, offsets, packing != "none", stats)


def epoch_order(n: int, seed: int, epoch: int) -> np.ndarray:
    """Epoch `epoch`'s permutation of the n rows (numpy's PCG64: the same on every machine)."""
    return np.random.Generator(np.random.PCG64(seed * 1_000_003 + epoch)).permutation(n)


def sample_indices(n: int, seed: int, start: int = 0) -> Iterator[int]:
    """Endless row indices from sample number `start` on."""
    epoch, offset = divmod(start, n)
    while True:
        yield from epoch_order(n, seed, epoch)[offset:].tolist()
        epoch, offset = epoch + 1, 0


def batch(rows: Rows, indices: list[int]) -> tuple[np.ndarray, ...]:
    """Rows `indices` stacked: (inputs, targets), and their positions where rows are packed
    (`rows.isolated`): [len(indices), seq_len] int64 each."""
    parts = list(zip(*(rows.row(i) for i in indices), strict=True))
    return tuple(np.stack(p) for p in parts[: 3 if rows.isolated else 2])


def train_windows(
    rows: Rows, *, batch_size: int, seed: int, start: int = 0
) -> Iterator[tuple[np.ndarray, ...]]:
    """Endless batches (see `batch`) of batch_size rows, after `start` samples."""
    indices = sample_indices(len(rows), seed, start)
    while True:
        yield batch(rows, [next(indices) for _ in range(batch_size)])


def eval_windows(rows: Rows, *, batch_size: int, n_batches: int) -> list[tuple[np.ndarray, ...]]:
    """The first n_batches batches of the validation split: the same every evaluation."""
    n = min(len(rows), batch_size * n_batches)
    return [batch(rows, list(range(s, min(s + batch_size, n)))) for s in range(0, n, batch_size)]
