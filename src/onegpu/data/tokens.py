"""Token files: tokenize a corpus once into cached nanoGPT-format `.bin` files, read by memory map.

A `.bin` file is a flat array of token ids (uint16, or uint32 for vocabularies over 65,536), no
header: nanoGPT's format, so files prepared by nanoGPT's scripts load as they are.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from dataclasses import replace
from pathlib import Path

import numpy as np

from onegpu.cache import cache_root
from onegpu.config import ConfigError, DataConfig
from onegpu.data.chat import default_template
from onegpu.data.encode import encode_example
from onegpu.data.examples import Example, Format, detect_format, make_format
from onegpu.data.sources import Source, open_source
from onegpu.data.splits import TokenSplits
from onegpu.data.tokenizer import BPETokenizer, ByteTokenizer, Tokenizer

FORMAT_VERSION = 2  # 2: loss masks and example starts beside the tokens


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


def _tokenizer_for(
    source: Source, examples: Callable[[str], Iterator[Example]], data: DataConfig, vocab: int
) -> Tokenizer:
    if data.tokenizer == "byte":
        if vocab < 256:
            raise ConfigError(
                "data.tokenizer",
                f"the byte tokenizer needs 256 ids, the model has {vocab}; use a model "
                "folder with a tokenizer.json",
            )
        return ByteTokenizer()
    vocab = data.tokenizer_vocab or vocab
    name = f"{source.key}-v{source.val_fraction}-bpe{vocab}.json"
    path = cache_root(data.cache_dir) / "tokenizers" / name
    if path.exists():
        try:
            return BPETokenizer.load(path, vocab)
        except Exception as e:  # a corrupt cache file: the cache is ours to rebuild
            print(
                f"onegpu: the cached tokenizer {path} is unreadable ({type(e).__name__}); "
                "training it again"
            )
            path.unlink(missing_ok=True)
    print(f"onegpu: training a {vocab}-token byte-level BPE on {source.path} (cached at {path})")
    return BPETokenizer.train((ex.text for ex in examples("train")), vocab, path)


def _write_split(
    examples: Iterator[Example], fmt: Format, tok: Tokenizer, folder: Path, split: str, dtype
) -> dict[str, int]:
    """Tokens, loss mask (formats that mask) and example starts of one split, streamed to
    `{split}.bin`, `{split}.mask.bin` and `{split}.docs.bin`; its counts."""
    counts = {"examples": 0, "tokens": 0, "trained": 0}
    with ExitStack() as files:
        ids_out = files.enter_context(open(folder / f"{split}.bin", "wb"))
        docs_out = files.enter_context(open(folder / f"{split}.docs.bin", "wb"))
        mask_out = (
            files.enter_context(open(folder / f"{split}.mask.bin", "wb")) if fmt.masks else None
        )
        for ex in examples:
            ids, trained = encode_example(tok, fmt, ex)
            np.array([counts["tokens"]], dtype=np.int64).tofile(docs_out)
            ids.astype(dtype).tofile(ids_out)
            if mask_out is not None:
                trained.astype(np.uint8).tofile(mask_out)
            counts["examples"] += 1
            counts["tokens"] += len(ids)
            counts["trained"] += int(trained.sum())
    return counts


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
    """A token folder is complete when meta.json parses and each file has its counted size."""
    try:
        meta = json.loads((folder / "meta.json").read_text())
        sizes = {"bin": dtype.itemsize, "docs.bin": 8, "mask.bin": 1}
        for split in ("train", "val"):
            c = meta[split]
            want = {"bin": c["tokens"], "docs.bin": c["examples"]}
            if meta["masked"]:
                want["mask.bin"] = c["tokens"]
            for suffix, n in want.items():
                if (folder / f"{split}.{suffix}").stat().st_size != int(n) * sizes[suffix]:
                    return False
        return True
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


def _write_token_cache(
    folder: Path,
    source: Source,
    fmt: Format,
    examples: Callable[[str], Iterator[Example]],
    tok,
    dtype,
) -> None:
    """Tokenize both splits into `folder` unless a complete cache is there: written under a
    temporary name and renamed into place, so a killed run leaves no half-made cache."""
    _remove_stale_tmp(folder)
    if folder.exists() and not _complete(folder, dtype):
        print(f"onegpu: the token cache {folder} is incomplete or corrupt; tokenizing again")
        shutil.rmtree(folder, ignore_errors=True)
    if (folder / "meta.json").exists():
        return
    tmp = folder.with_name(folder.name + f".tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        counts = {s: _write_split(examples(s), fmt, tok, tmp, s, dtype) for s in ("train", "val")}
    except BaseException:  # failed or interrupted: leave no half-made folder behind
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    meta = {
        "source": str(source.path),
        "kind": source.kind,
        "format": fmt.name,
        "masked": fmt.masks,
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
    """Token arrays (and loss masks) for the train and validation splits of `data.source`,
    cached on disk: source -> examples -> tokens and masks -> the cache both backends read.
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

    source = open_source(data.source, val_fraction=data.val_fraction, split=data.split)
    fmt = source_format(source, data, tokenizer)

    def examples(split: str) -> Iterator[Example]:
        for name, record in source.records(split):
            yield fmt.to_example(record, f"{name} of {source.path}")

    tok = tokenizer or _tokenizer_for(source, examples, data, model_vocab)
    if tok.vocab_size > model_vocab:
        raise ConfigError(
            "data.tokenizer",
            f"the {tok.name} tokenizer has {tok.vocab_size} ids, more than the model's "
            f"{model_vocab} embedding rows; use a tokenizer that fits the model",
        )
    dtype = token_dtype(tok.vocab_size)
    name = f"{source.key}-v{source.val_fraction}-{tok.name}-{fmt.key}-f{FORMAT_VERSION}"
    folder = cache_root(data.cache_dir) / "tokens" / name
    _write_token_cache(folder, source, fmt, examples, tok, dtype)
    splits = _read_cache(
        folder, dtype, tok, f"{source.kind}:{source.path} ({fmt.name}, {tok.name})"
    )
    splits.chat_template = fmt.chat_template
    splits.format = fmt.name
    return splits


def source_format(source: Source, data: DataConfig, tokenizer: Tokenizer | None) -> Format:
    """The format of `source`'s records; a chat is rendered with the model folder's template
    where it has one, else onegpu's default."""
    if source.is_text:
        if data.format not in ("auto", "text"):
            raise ConfigError(
                "data.format",
                f"{data.format} needs records with fields; {source.path} is plain text (give "
                "JSONL, JSON, Parquet or a datasets folder, or --data.format text)",
            )
        return make_format(replace(data, text_field="text"), {"text": ""}, None)
    first = source.first_record()
    chat = None
    if detect_format(data, first) == "chat":
        chat = getattr(tokenizer, "chat_template", lambda: None)()
        if chat is None and tokenizer is not None:
            print(f"onegpu: {tokenizer.name} has no chat template; using onegpu's default")
        chat = chat or default_template()
    return make_format(data, first, chat)


def _read_cache(folder: Path, dtype: np.dtype, tok: Tokenizer, description: str) -> TokenSplits:
    meta = json.loads((folder / "meta.json").read_text())
    masks = {
        s: read_bin(folder / f"{s}.mask.bin", np.uint8) if meta["masked"] else None
        for s in ("train", "val")
    }
    docs = {s: read_bin(folder / f"{s}.docs.bin", np.int64) for s in ("train", "val")}
    return TokenSplits(
        read_bin(folder / "train.bin", dtype),
        read_bin(folder / "val.bin", dtype),
        tok,
        description,
        train_mask=masks["train"],
        val_mask=masks["val"],
        counts={s: meta[s] for s in ("train", "val")},
        train_docs=docs["train"],
        val_docs=docs["val"],
    )
