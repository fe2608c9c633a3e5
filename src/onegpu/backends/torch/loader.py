"""Packed sequences, a deterministic shuffled loader, and a device prefetcher.

The token stream is cut into non-overlapping windows of seq_len + 1 tokens (inputs and shifted
targets). Each optimizer step takes one host batch of `train.batch_size` windows; the trainer
splits it into micro-batches on the device. Token ids are tiny next to activations, so copying
the whole step's batch at once, one step ahead, costs no memory that matters and overlaps the
host-to-device copy with compute completely (asynchronous I/O, as "Optimising the Training Loop" recommends).
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, Sampler

from onegpu.data import windows
from onegpu.data.windows import IGNORE_INDEX, sample_indices

"""Target value excluded from the loss (padding); torch's cross_entropy default."""


def classification_targets(inputs_BT: torch.Tensor, classes: int) -> torch.Tensor:
    """Targets of a sequence classifier in the step's [B, T] layout: each sequence's label in
    column 0, IGNORE_INDEX elsewhere, so the step's target count is the number of labels. The
    label is the first input token's id modulo `classes` (see classification_example)."""
    targets = torch.full_like(inputs_BT, IGNORE_INDEX)
    targets[..., 0] = inputs_BT[..., 0] % classes
    return targets


def placeholder_batch(
    batch: int, seq_len: int, classes: int | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(inputs, targets) of zeros in a step's shapes, for following a step on fake tensors
    (the planner, the matmul floor): a classifier's targets are its labels' layout."""
    tokens = torch.zeros(batch, seq_len + 1, dtype=torch.long)
    x, y = tokens[:, :-1], tokens[:, 1:]
    return x, classification_targets(x, classes) if classes else y


def classification_example(
    window_T: torch.Tensor, classes: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """A labelled sequence from a window of tokens: its first token becomes one of `classes`
    ids and is the label (a [CLS] position that carries its class). HF's guide measures on
    random labels, which no model can learn; this task is learnt in a few dozen steps by a
    classifier that reads its first position, so a falling loss shows that training works,
    while speed and memory are those of random data."""
    x = window_T.clone()
    x[0] = x[0] % classes
    return x, classification_targets(x, classes)


class PackedSequences(Dataset):
    """The rows of a split (data/windows.py: windows of the stream, or examples) as (inputs,
    targets[, positions]) int64 tensors (`classes` > 0: a classifier's targets, see
    classification_targets)."""

    def __init__(self, rows: windows.Rows, classes: int = 0):
        self.rows = rows
        self.classes = classes

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, ...]:
        """(inputs, targets), and the positions of packed rows (`rows.isolated`)."""
        if self.classes:
            window = torch.from_numpy(self.rows.window(i))
            return classification_example(window[:-1], self.classes)
        parts = self.rows.row(i)[: 3 if self.rows.isolated else 2]
        return tuple(torch.from_numpy(a) for a in parts)


class EpochShuffleSampler(Sampler[int]):
    """Endless indices: a fresh permutation per epoch, fixed by (seed, epoch).

    The position is (epoch, offset), so a resumed run can continue exactly where it stopped.
    """

    def __init__(self, n: int, seed: int, start: int = 0):
        self.n, self.seed, self.start = n, seed, start

    def __iter__(self) -> Iterator[int]:
        return sample_indices(self.n, self.seed, self.start)

    def __len__(self) -> int:  # pragma: no cover - endless; DataLoader asks only for len()
        return 2**62


def make_train_loader(
    rows: windows.Rows,
    *,
    batch_size: int,
    seed: int,
    num_workers: int,
    pin_memory: bool,
    start: int = 0,
    classes: int = 0,
) -> DataLoader:
    """Endless shuffled batches, starting after `start` samples (a resumed run's position)."""
    data = PackedSequences(rows, classes)
    return DataLoader(
        data,
        batch_size=batch_size,
        sampler=EpochShuffleSampler(len(data), seed, start),
        num_workers=num_workers,
        pin_memory=pin_memory,
        persistent_workers=num_workers > 0,
        drop_last=True,
    )


def make_eval_batches(
    rows: windows.Rows, *, batch_size: int, n_batches: int, classes: int = 0
) -> list:
    """The first n_batches batches of the validation split: the same every evaluation."""
    data = PackedSequences(rows, classes)
    n = min(len(data), batch_size * n_batches)
    return [
        tuple(torch.stack(t) for t in zip(*(data[i] for i in range(s, min(s + batch_size, n)))))
        for s in range(0, n, batch_size)
    ]


def count_targets(targets: torch.Tensor) -> int:
    """Tokens that count in the loss, counted on the host (numpy: no torch op, no device sync)."""
    return int(np.count_nonzero(targets.numpy() != IGNORE_INDEX))


class DevicePrefetcher:
    """Yields batches on the device while the next one is already being copied.

    On CUDA the copy runs on a side stream from pinned memory (`non_blocking=True`), and the
    compute stream waits for it only when the batch is used. On the CPU the copy is a no-op.
    """

    def __init__(self, batches: Iterator, device: torch.device):
        self.batches = iter(batches)
        self.device = device
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self._next = self._copy(next(self.batches))

    def _copy(self, batch):
        def to_device(t):
            return t.to(self.device, non_blocking=True) if isinstance(t, torch.Tensor) else t

        if self.stream is None:
            return tuple(map(to_device, batch))
        with torch.cuda.stream(self.stream):
            return tuple(map(to_device, batch))

    def __iter__(self):
        return self

    def __next__(self):
        batch = self._next
        if self.stream is not None:
            current = torch.cuda.current_stream(self.device)
            current.wait_stream(self.stream)
            for t in batch:  # the caching allocator must not reuse this memory early
                if isinstance(t, torch.Tensor):
                    t.record_stream(current)
        self._next = self._copy(next(self.batches))
        return batch
