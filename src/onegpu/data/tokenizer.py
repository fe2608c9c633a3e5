"""Tokenizers that need no download: UTF-8 bytes, or a byte-level BPE trained here.

Documents are separated by an end-of-text token: byte 0 for the byte tokenizer (NUL never
occurs in text), `<|endoftext|>` (id 0) for BPE, as GPT-2 does.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path
from typing import Protocol

import numpy as np

from onegpu.config import ConfigError


class Tokenizer(Protocol):
    name: str
    vocab_size: int
    eot_id: int

    def encode(self, text: str) -> list[int] | np.ndarray: ...
    def encode_batch(self, texts: list[str]) -> list[np.ndarray]: ...
    def encode_spans(self, text: str, special_tokens: bool) -> tuple[np.ndarray, np.ndarray]: ...
    def decode(self, ids: Iterable[int]) -> str: ...


class ByteTokenizer:
    name = "byte"
    vocab_size = 256
    eot_id = 0

    def encode(self, text: str) -> np.ndarray:
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.int64)

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        return [self.encode(t) for t in texts]

    def encode_spans(self, text: str, special_tokens: bool) -> tuple[np.ndarray, np.ndarray]:
        """Token ids and each token's [start, end) characters of `text` ([N, 2])."""
        ids = self.encode(text)
        widths = np.array([len(c.encode("utf-8")) for c in text], dtype=np.int64)
        starts = np.repeat(np.arange(len(text), dtype=np.int64), widths)
        return ids, np.stack([starts, starts + 1], axis=1).reshape(-1, 2)

    def decode(self, ids: Iterable[int]) -> str:
        return bytes(int(i) for i in ids if i != self.eot_id).decode("utf-8", errors="replace")

    def to_tokenizers(self):
        """The same mapping as a `tokenizers.Tokenizer` (id = byte value; no merges), so that
        exported byte-level models load with transformers' AutoTokenizer."""
        from tokenizers import Tokenizer as HFTokenizer
        from tokenizers import decoders, models, pre_tokenizers

        vocab = {ch: b for b, ch in _bytes_to_unicode().items()}
        tok = HFTokenizer(models.BPE(vocab=vocab, merges=[]))
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
        tok.decoder = decoders.ByteLevel()
        return tok


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's printable stand-in character for each byte (the ByteLevel alphabet)."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    chars, extra = {b: chr(b) for b in printable}, 0
    for b in range(256):
        if b not in chars:
            chars[b] = chr(256 + extra)
            extra += 1
    return chars


class BPETokenizer:
    """A `tokenizers` byte-level BPE (GPT-2's pre-tokenizer and byte alphabet)."""

    eot_token = "<|endoftext|>"

    def __init__(self, tok, vocab_size: int):
        self._tok = tok
        self.vocab_size = vocab_size
        self.name = f"bpe{vocab_size}"
        self.eot_id = tok.token_to_id(self.eot_token)

    @classmethod
    def train(cls, texts: Iterable[str], vocab_size: int, path: Path) -> BPETokenizer:
        from tokenizers import Tokenizer as HFTokenizer
        from tokenizers import decoders, models, pre_tokenizers, trainers

        tok = HFTokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(
            vocab_size=vocab_size,
            special_tokens=[cls.eot_token],
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            show_progress=False,
        )
        tok.train_from_iterator(texts, trainer=trainer)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        tok.save(str(tmp))
        os.replace(tmp, path)  # atomic: a concurrent run never reads half a file
        return cls(tok, vocab_size)

    @classmethod
    def load(cls, path: Path, vocab_size: int) -> BPETokenizer:
        from tokenizers import Tokenizer as HFTokenizer

        return cls(HFTokenizer.from_file(str(path)), vocab_size)

    def encode(self, text: str) -> np.ndarray:
        return np.asarray(self._tok.encode(text).ids, dtype=np.int64)

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        return [np.asarray(e.ids, dtype=np.int64) for e in self._tok.encode_batch(texts)]

    def encode_spans(self, text: str, special_tokens: bool) -> tuple[np.ndarray, np.ndarray]:
        """Token ids and each token's [start, end) characters of `text` ([N, 2]; a special
        token the tokenizer adds covers none)."""
        e = self._tok.encode(text, add_special_tokens=special_tokens)
        spans = np.asarray(e.offsets, dtype=np.int64).reshape(-1, 2)
        return np.asarray(e.ids, dtype=np.int64), spans

    def decode(self, ids: Iterable[int]) -> str:
        return self._tok.decode([int(i) for i in ids])

    def to_tokenizers(self):
        return self._tok


class FileTokenizer(BPETokenizer):
    """A model folder's own tokenizer.json (any `tokenizers` model: BPE, Unigram, WordPiece).
    Its name carries a hash of the file, so token caches never mix two tokenizers."""

    def __init__(self, path: Path, eot_id: int | None):
        import hashlib

        from tokenizers import Tokenizer as HFTokenizer

        try:
            tok = HFTokenizer.from_file(str(path))
        except Exception as e:  # tokenizers raises a bare Exception on a malformed file
            raise ConfigError(
                "model.hf", f"{path} is not a readable tokenizer.json ({str(e).splitlines()[0]})"
            ) from None
        self._tok = tok
        self.vocab_size = tok.get_vocab_size(with_added_tokens=True)
        digest = hashlib.sha1(path.read_bytes()).hexdigest()[:12]
        self.name = f"file-{digest}"
        self.eot_id = eot_id if eot_id is not None else 0
        self.path = path

    def chat_template(self):
        """The folder's chat template (data/chat.py), None where its tokenizer has none."""
        from onegpu.data.chat import folder_template

        return folder_template(self.path.parent)
