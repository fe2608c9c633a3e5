"""Token files: tokenize a corpus once into cached nanoGPT-format `.bin` files, read by memory map.

A `.bin` file is a flat array of token ids (uint16, or uint32 for vocabularies over 65,536), no
header: nanoGPT's format, so files prepared by nanoGPT's scripts load as they are.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from onegpu.cache import cache_root
from onegpu.config import ConfigError, DataConfig
from onegpu.data.corpus import Corpus, open_corpus
from onegpu.data.tokenizer import BPETokenizer, ByteTokenizer, Tokenizer

FORMAT_VERSION = 1


@dataclass(slots=True)
class TokenSplits:
    train: np.ndarray
    val: np.ndarray
    tokenizer: Tokenizer | None  # None for pre-tokenized .bin input
    description: str
    _fingerprint: str = ""

    def fingerprint(self) -> str:
        """What the run trains on, in a few words: the splits' sizes and a hash of their
        tokens (all of them up to 64 MiB a split; beyond, 1,024 windows of 64 KiB spread over
        it, first and last included), computed once. A checkpoint records it, so a resume on
        changed data (text appended, another file) is caught."""
        if not self._fingerprint:
            h = hashlib.blake2b(digest_size=12)
            for split in (self.train, self.val):
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


def token_dtype(vocab_size: int) -> np.dtype:
    return np.dtype(np.uint16 if vocab_size <= 2**16 else np.uint32)


def write_bin(path: Path, tokens: np.ndarray, dtype: np.dtype | str) -> None:
    np.asarray(tokens).astype(dtype).tofile(path)


def read_bin(path: Path, dtype: np.dtype | str) -> np.ndarray:
    """Memory-map a token file; a size that is not a whole number of tokens means corruption."""
    dtype = np.dtype(dtype)
    size = path.stat().st_size
    if size % dtype.itemsize:
        raise ConfigError(
            "data.source",
            f"{path} is {size} bytes, not a whole number of {dtype.name} tokens; "
            "the file is truncated or data.bin_dtype is wrong",
        )
    if size == 0:
        return np.zeros(0, dtype=dtype)
    return np.memmap(path, dtype=dtype, mode="r")


def _check_ids(tokens: np.ndarray, vocab_size: int, path: Path) -> None:
    hi = 0
    for start in range(0, len(tokens), 1 << 26):
        hi = max(hi, int(tokens[start : start + (1 << 26)].max(initial=0)))
    if hi >= vocab_size:
        raise ConfigError(
            "model.vocab_size",
            f"{path} holds token id {hi}, but model.vocab_size is {vocab_size}; set it to at least {hi + 1}",
        )


def _load_pretokenized(path: Path, data: DataConfig, vocab_size: int) -> TokenSplits:
    if path.is_dir():
        train_path, val_path = path / "train.bin", path / "val.bin"
        train = read_bin(train_path, data.bin_dtype)
        val = read_bin(val_path, data.bin_dtype) if val_path.exists() else None
    else:
        train_path = path
        train, val = read_bin(path, data.bin_dtype), None
    if val is None:  # hold out the tail
        cut = len(train) - int(len(train) * data.val_fraction)
        train, val = train[:cut], train[cut:]
    _check_ids(train, vocab_size, train_path)
    _check_ids(val, vocab_size, train_path)
    return TokenSplits(train, val, None, f"{path} ({data.bin_dtype} tokens)")


SYNTHETIC_TOKENS = (1 << 20, 1 << 16)  # train, validation


def synthetic_tokens(vocab_size: int) -> TokenSplits:
    """Uniform random token ids from a fixed seed: the dummy data of HF's single-GPU guide,
    for measuring speed and memory (and for classifiers, whose labels the loader derives)."""
    rng = np.random.default_rng(0)
    dtype = token_dtype(vocab_size)
    train, val = (rng.integers(0, vocab_size, n).astype(dtype) for n in SYNTHETIC_TOKENS)
    return TokenSplits(train, val, None, f"synthetic (uniform over {vocab_size} ids)")


def _tokenizer_for(corpus: Corpus, data: DataConfig, model_vocab: int) -> Tokenizer:
    if data.tokenizer == "byte":
        if model_vocab < 256:
            raise ConfigError(
                "data.tokenizer",
                f"the byte tokenizer needs 256 ids, the model has {model_vocab}; use a model "
                "folder with a tokenizer.json",
            )
        return ByteTokenizer()
    vocab = data.tokenizer_vocab or model_vocab
    path = (
        cache_root(data.cache_dir)
        / "tokenizers"
        / f"{corpus.key}-v{corpus.val_fraction}-bpe{vocab}.json"
    )
    if path.exists():
        try:
            return BPETokenizer.load(path, vocab)
        except Exception as e:  # a corrupt cache file: the cache is ours to rebuild
            print(
                f"onegpu: the cached tokenizer {path} is unreadable ({type(e).__name__}); "
                "training it again"
            )
            path.unlink(missing_ok=True)
    print(f"onegpu: training a {vocab}-token byte-level BPE on {corpus.path} (cached at {path})")
    return BPETokenizer.train(corpus.documents("train"), vocab, path)


def _tokenize_split(corpus: Corpus, split: str, tok: Tokenizer, out: Path, dtype: np.dtype) -> int:
    n = 0
    with open(out, "wb") as fh:
        batch: list[str] = []

        def flush() -> None:
            nonlocal n
            for ids in tok.encode_batch(batch):
                arr = np.empty(len(ids) + 1, dtype=dtype)
                arr[0] = tok.eot_id  # separates documents, as GPT-2's <|endoftext|>
                arr[1:] = ids
                arr.tofile(fh)
                n += len(arr)
            batch.clear()

        for doc in corpus.documents(split):
            batch.append(doc)
            if len(batch) == 256:
                flush()
        flush()
    return n


def check_cache_writable(data: DataConfig) -> None:
    root = cache_root(data.cache_dir)
    try:
        root.mkdir(parents=True, exist_ok=True)
        probe = root / f".onegpu-write-test.{os.getpid()}"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as e:
        raise ConfigError(
            "data.cache_dir",
            f"cannot write the token cache in {root} ({e.strerror}); "
            "set --data.cache_dir (or $ONEGPU_CACHE) to a writable folder",
        ) from None


def _complete(folder: Path, dtype: np.dtype) -> bool:
    """A token folder is complete when meta.json parses and each split has its counted size."""
    try:
        meta = json.loads((folder / "meta.json").read_text())
        return all(
            (folder / f"{s}.bin").stat().st_size == int(meta[s]) * dtype.itemsize
            for s in ("train", "val")
        )
    except (OSError, ValueError, KeyError, TypeError):
        return False


def _remove_stale_tmp(folder: Path) -> None:
    """Temporary folders of tokenizations whose process is gone (killed mid-way)."""
    for tmp in folder.parent.glob(f"{folder.name}.tmp*") if folder.parent.exists() else []:
        pid = tmp.name.rsplit(".tmp", 1)[-1]
        if pid.isdigit() and not _alive(int(pid)):
            shutil.rmtree(tmp, ignore_errors=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _write_token_cache(folder: Path, corpus, tok: Tokenizer, dtype) -> None:
    """Tokenize both splits into `folder` unless a complete cache is there: written under a
    temporary name and renamed into place, so a killed run leaves no half-made cache."""
    _remove_stale_tmp(folder)
    if folder.exists() and not _complete(folder, dtype):
        print(f"onegpu: the token cache {folder} is incomplete or corrupt; tokenizing again")
        shutil.rmtree(folder, ignore_errors=True)
    if not (folder / "meta.json").exists():
        tmp = folder.with_name(folder.name + f".tmp{os.getpid()}")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        try:
            counts = {
                s: _tokenize_split(corpus, s, tok, tmp / f"{s}.bin", dtype)
                for s in ("train", "val")
            }
        except BaseException:  # failed or interrupted: leave no half-made folder behind
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        meta = {
            "source": str(corpus.path),
            "kind": corpus.kind,
            "tokenizer": tok.name,
            "dtype": dtype.name,
            **counts,
        }
        (tmp / "meta.json").write_text(json.dumps(meta, indent=1))
        try:
            os.replace(tmp, folder)
        except OSError:  # another process finished first: use its files
            shutil.rmtree(tmp, ignore_errors=True)


def prepare_tokens(
    data: DataConfig, model_vocab: int, tokenizer: Tokenizer | None = None
) -> TokenSplits:
    """Token arrays for the train and validation splits of `data.source`, cached on disk.
    `tokenizer` (a model folder's own) replaces the one `data.tokenizer` names."""
    if data.source == "synthetic":
        return synthetic_tokens(model_vocab)
    check_cache_writable(data)
    source_path = Path(data.source).expanduser()
    if data.source != "stdlib" and (
        source_path.suffix == ".bin"
        or (source_path.is_dir() and (source_path / "train.bin").exists())
    ):
        if not source_path.exists():
            raise ConfigError("data.source", f"{data.source!r} does not exist")
        return _load_pretokenized(source_path, data, model_vocab)

    corpus = open_corpus(data.source, val_fraction=data.val_fraction, text_field=data.text_field)
    tok = tokenizer or _tokenizer_for(corpus, data, model_vocab)
    if tok.vocab_size > model_vocab:
        raise ConfigError(
            "data.tokenizer",
            f"the {tok.name} tokenizer has {tok.vocab_size} ids, more than the model's "
            f"{model_vocab} embedding rows; use a tokenizer that fits the model",
        )
    dtype = token_dtype(tok.vocab_size)
    folder = (
        cache_root(data.cache_dir)
        / "tokens"
        / f"{corpus.key}-v{corpus.val_fraction}-{tok.name}-f{FORMAT_VERSION}"
    )
    _write_token_cache(folder, corpus, tok, dtype)
    train = read_bin(folder / "train.bin", dtype)
    val = read_bin(folder / "val.bin", dtype)
    return TokenSplits(train, val, tok, f"{corpus.kind}:{corpus.path} ({tok.name})")
