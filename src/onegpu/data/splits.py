"""What a run trains on: the token arrays of both splits, their loss masks and where their
examples start, and the rows they are cut into (data/windows.py), for both backends."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

import numpy as np

from onegpu.config import ConfigError, DataConfig
from onegpu.data.tokenizer import Tokenizer
from onegpu.data.windows import Rows, example_rows


def refuse_overlong(split: str, n_tokens: int, starts: np.ndarray, limit: int) -> None:
    """`data.overlong error`: the first example longer than `limit` tokens, named."""
    lengths = np.diff(np.append(starts, n_tokens))
    over = np.flatnonzero(lengths > limit)
    if len(over):
        first = int(over[0])
        raise ConfigError(
            "data.overlong",
            f"example {first} of the {split} split has {int(lengths[first])} tokens, over the "
            f"limit of {limit} (data.max_len, or the row's seq_len + 1; {len(over)} examples "
            "are over); raise model.seq_len or data.max_len, or set data.overlong truncate or "
            "drop",
        )


@dataclass(slots=True)
class TokenSplits:
    train: np.ndarray
    val: np.ndarray
    tokenizer: Tokenizer | None  # None for pre-tokenized .bin input
    description: str
    train_mask: np.ndarray | None = None
    """1 where a token is trained as a target, 0 where masked (None: every token trained)."""
    val_mask: np.ndarray | None = None
    counts: dict[str, dict[str, int]] = field(default_factory=dict)
    """Per split: examples, tokens, trained tokens (empty for .bin and synthetic data)."""
    chat_template: str | None = None
    """The chat template conversations were rendered with (chat data only): the run folder
    keeps it, so export and `generate --chat` render prompts as training did."""
    format: str = "text"
    train_docs: np.ndarray | None = None
    """Where each example starts (None: .bin and synthetic data, which have no examples)."""
    val_docs: np.ndarray | None = None
    train_rows: Rows | None = None
    """The splits cut into rows of seq_len (`cut`, once the run's seq_len is known)."""
    val_rows: Rows | None = None
    packing: str = ""

    def cut(self, data: DataConfig, seq_len: int) -> TokenSplits:
        """Cut both splits into rows as `data.packing` says (data/windows.py)."""
        packing = data.packing
        if packing == "auto":
            packing = "stream" if self.format == "text" else "none"
        self.packing = packing
        for split, tokens, docs in (
            ("training", self.train, self.train_docs),
            ("validation", self.val, self.val_docs),
        ):
            if data.overlong == "error" and packing != "stream" and docs is not None:
                refuse_overlong(split, len(tokens), docs, data.max_len or seq_len + 1)
        self.train_rows = self._rows(self.train, self.train_mask, self.train_docs, data, seq_len)
        self.val_rows = self._rows(self.val, self.val_mask, self.val_docs, data, seq_len)
        return self

    def report(self) -> dict[str, object]:
        """summary.json's data section: how rows were made, and what padding and over-long
        examples cost (training split)."""
        assert self.train_rows is not None, "cut() first"
        return {"packing": self.packing, **self.train_rows.stats, "counts": self.counts}

    def rows_note(self) -> str:
        """The start line's few words on the rows ('' for windows of the stream)."""
        stats = self.train_rows.stats if self.train_rows is not None else {}
        if not stats:
            return ""
        per_row = "one example a row" if self.packing == "none" else f"{self.packing}-packed"
        note = f", {per_row}, {stats['padding']:.0%} padding"
        if stats["overlong"]:
            kept = "dropped" if stats["dropped"] else "truncated"
            note += f", {stats['overlong']} over-long {kept} ({stats['tokens_lost']} tokens)"
        return note

    def _rows(self, tokens, mask, docs, data: DataConfig, seq_len: int) -> Rows:
        if self.packing == "stream":
            return Rows(tokens, seq_len, mask)
        if docs is None:
            raise ConfigError(
                "data.packing",
                f"{self.packing} needs examples; {self.description} is a token stream (use stream)",
            )
        return example_rows(
            tokens,
            docs,
            seq_len,
            mask=mask,
            packing=self.packing,
            max_len=data.max_len,
            drop_overlong=data.overlong == "drop",
        )

    _fingerprint: str = ""

    def fingerprint(self) -> str:
        """What the run trains on, in a few words: the splits' sizes and a hash of their
        tokens (all of them up to 64 MiB a split; beyond, 1,024 windows of 64 KiB spread over
        it, first and last included), computed once. A checkpoint records it, so a resume on
        changed data (text appended, another file) is caught."""
        if not self._fingerprint:
            h = hashlib.blake2b(digest_size=12)
            masks = [m for m in (self.train_mask, self.val_mask) if m is not None]
            for split in (self.train, self.val, *masks):
                a = np.ascontiguousarray(split).view(np.uint8).reshape(-1)
                h.update(f"{split.dtype.str}:{len(split)};".encode())
                if a.nbytes <= 64 * 2**20:
                    h.update(a.data)
                    continue
                window = 64 * 2**10
                for start in np.linspace(0, a.nbytes - window, 1024).astype(np.int64):
                    h.update(a[start : start + window].data)
            self._fingerprint = f"{len(self.train)}+{len(self.val)} tokens, {h.hexdigest()}"
        return self._fingerprint
