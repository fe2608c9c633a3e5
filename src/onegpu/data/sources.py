"""Where records come from: the embedded default corpus, text files and folders, JSON Lines,
JSON arrays, Parquet files and folders, and folders written by `datasets`' `save_to_disk`.

Every source yields named records (`{field: value}`; a text file is one record with a `text`
field) in a fixed order and puts each in train or validation by a stable hash of its name, so
the split never depends on file-system order, train and validation never share a record, and
the same rows in another container (JSONL, a JSON array, Parquet, a saved Dataset) split alike:
a row's name is its 1-based number. Columnar sources are read a batch at a time (Parquet row
groups, a saved Dataset's memory-mapped Arrow files): a source larger than memory is tokenized
without being loaded whole.
"""

from __future__ import annotations

import hashlib
import json
import os
import sysconfig
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from onegpu.config import ConfigError

TEXT_SUFFIXES = {".txt", ".md", ".rst", ".py", ".text", ""}
# Not part of the standard library proper (site-packages), or test data that dwarfs it.
STDLIB_SKIP_DIRS = {"site-packages", "dist-packages", "__pycache__", "test", "tests", "idle_test"}
ROW_BATCH = 1024
Record = dict[str, Any]


@dataclass(frozen=True, slots=True)
class Source:
    """A source of records: `key` changes whenever its content may have changed (for caching)."""

    kind: str  # "stdlib" | "text" | "folder" | "jsonl" | "json" | "parquet" | "arrow"
    path: Path
    key: str
    val_fraction: float
    split: str = ""  # the DatasetDict split an "arrow" source reads

    @property
    def is_text(self) -> bool:
        """Plain text files: each file is one `text` record."""
        return self.kind in ("stdlib", "text", "folder")

    def records(self, split: str) -> Iterator[tuple[str, Record]]:
        """(name, record) of one split ('train' or 'val'), in a fixed order."""
        assert split in ("train", "val")
        if self.kind == "text":
            yield self.path.name, {"text": _split_single_text(self.path, self.val_fraction, split)}
            return
        for name, record in self._named_records():
            if in_val(name, self.val_fraction) == (split == "val"):
                yield name, record

    def first_record(self) -> Record:
        """The first record of the source (what the format is detected from)."""
        for _, record in self._named_records():
            return record
        raise ConfigError("data.source", f"{self.path} holds no records")

    def _named_records(self) -> Iterator[tuple[str, Record]]:
        if self.kind in ("stdlib", "folder", "text"):
            files = [self.path] if self.kind == "text" else _list_text_files(self.path, self.kind)
            for f in files:
                name = self.path.name if self.kind == "text" else str(f.relative_to(self.path))
                yield name, {"text": f.read_text(encoding="utf-8", errors="replace")}
            return
        rows = {
            "jsonl": _jsonl_rows,
            "json": _json_array_rows,
            "parquet": _parquet_rows,
            "arrow": _arrow_rows,
        }[self.kind](self)
        for number, record in enumerate(rows, 1):
            yield f"record-{number}", record


def in_val(name: str, val_fraction: float) -> bool:
    digest = hashlib.sha1(name.encode()).digest()
    return int.from_bytes(digest[:4], "big") / 2**32 < val_fraction


def _split_single_text(path: Path, val_fraction: float, split: str) -> str:
    text = path.read_text(encoding="utf-8-sig", errors="replace")
    cut = len(text) - int(len(text) * val_fraction)
    nl = text.find("\n", cut)  # cut at a line boundary
    cut = nl + 1 if nl != -1 and val_fraction > 0 else cut
    return text[:cut] if split == "train" else text[cut:]


# ------------------------------------------------------------------------------ row readers


def _jsonl_rows(source: Source) -> Iterator[Record]:
    with open(source.path, encoding="utf-8") as fh:
        for lineno, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise ConfigError(
                    "data.source", f"{source.path}:{lineno} is not valid JSON ({e})"
                ) from None
            yield _as_record(record, f"line {lineno} of {source.path}")


def _json_array_rows(source: Source) -> Iterator[Record]:
    """The records of a JSON array file, decoded one at a time from a window of the text: a
    file larger than memory streams (`datasets` reads a JSON array whole)."""
    number = 0
    try:
        for number, record in enumerate(_json_array_items(source.path), 1):
            yield _as_record(record, f"record {number} of {source.path}")
    except json.JSONDecodeError as e:
        raise ConfigError(
            "data.source", f"{source.path} is not valid JSON after record {number} ({e.msg})"
        ) from None
    except _NotAnArray as e:
        raise ConfigError(
            "data.source",
            f"{source.path} holds a JSON {e}, not an array; give an array of records "
            "([{...}, ...]) or JSON Lines (.jsonl)",
        ) from None


class _NotAnArray(Exception):
    """The file's top-level JSON value is not an array (the message names what it is)."""


def _json_array_items(path: Path, window: int = 1 << 20) -> Iterator[Any]:
    """Each element of the JSON array in `path`, with the stdlib decoder's raw_decode at each
    element of a text window that grows only while an element is unfinished."""
    decoder = json.JSONDecoder()
    with path.open(encoding="utf-8-sig") as f:
        text, at, done = "", 0, False

        def more() -> bool:
            nonlocal text, at, done
            chunk = f.read(window)
            done = not chunk
            text, at = text[at:] + chunk, 0
            return not done

        def next_char() -> str:
            nonlocal at
            while True:
                while at < len(text) and text[at].isspace():
                    at += 1
                if at < len(text) or not more():
                    return text[at] if at < len(text) else ""

        first = next_char()
        if first != "[":
            raise _NotAnArray("object" if first == "{" else "value")
        at += 1
        if next_char() == "]":
            return
        while True:
            try:
                item, end = decoder.raw_decode(text, at)
                after = end
                while after < len(text) and text[after].isspace():
                    after += 1
                if after == len(text) or text[after] not in ",]":  # unfinished: "3" of "3.25"
                    raise json.JSONDecodeError("expected ',' or ']'", text, after)
            except json.JSONDecodeError:
                if done or not more():
                    raise
                continue
            yield item
            at = after + 1
            if text[after] == "]":
                return
            next_char()


def _as_record(record: Any, where: str) -> Record:
    if not isinstance(record, dict):
        raise ConfigError(
            "data.source",
            f"{where} is a JSON {type(record).__name__}, not an object: give one "
            '{"text": "..."} (or prompt/response, or messages) object per record',
        )
    return record


def _parquet_rows(source: Source) -> Iterator[Record]:
    import pyarrow.parquet as pq

    files = [source.path] if source.path.is_file() else sorted(source.path.glob("*.parquet"))
    for f in files:
        try:
            batches = pq.ParquetFile(f).iter_batches(batch_size=ROW_BATCH)
            for batch in batches:
                yield from batch.to_pylist()
        except (OSError, ValueError) as e:  # pyarrow's ArrowInvalid is a ValueError
            raise ConfigError(
                "data.source", f"{f} is not a readable Parquet file ({_first_line(e)})"
            ) from None


def _arrow_rows(source: Source) -> Iterator[Record]:
    dataset = open_saved_dataset(source.path, source.split)
    for batch in dataset.iter(batch_size=ROW_BATCH):
        columns = list(batch)
        for i in range(len(batch[columns[0]]) if columns else 0):
            yield {c: batch[c][i] for c in columns}


def open_saved_dataset(path: Path, split: str) -> Any:
    """A folder written by `Dataset.save_to_disk` (memory-mapped), or one split of a
    `DatasetDict`'s (`data.split`; default 'train')."""
    import datasets

    try:
        loaded = datasets.load_from_disk(str(path))
    except Exception as e:  # datasets raises FileNotFoundError / ValueError / its own
        raise ConfigError(
            "data.source", f"{path} is not a readable datasets folder ({_first_line(e)})"
        ) from None
    if not isinstance(loaded, datasets.DatasetDict):
        return loaded
    name = split or "train"
    if name not in loaded:
        raise ConfigError(
            "data.split",
            f"{path} is a DatasetDict without a {name!r} split; choose one of "
            f"{', '.join(sorted(loaded))} with --data.split",
        )
    return loaded[name]


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


# ------------------------------------------------------------------------------ opening


def _list_text_files(root: Path, kind: str) -> list[Path]:
    """The text files under `root`, sorted (the token cache's fingerprint follows this order).
    Skipped folders are pruned, not walked: the standard library's folder holds site-packages,
    ~90,000 entries with torch installed, which took 6 s to list and drop."""
    stdlib = kind == "stdlib"
    skipped = STDLIB_SKIP_DIRS if stdlib else set()
    files = []
    for folder, dirs, names in os.walk(root):
        dirs[:] = [d for d in dirs if not d.startswith(".") and d not in skipped]
        for name in names:
            f = Path(folder, name)
            wanted = f.suffix == ".py" if stdlib else f.suffix.lower() in TEXT_SUFFIXES
            if wanted and not name.startswith(".") and f.is_file():
                files.append(f)
    return sorted(files)


def _fingerprint(files: list[Path], root: Path) -> str:
    h = hashlib.sha1()
    for f in files:
        st = f.stat()
        h.update(f"{f.relative_to(root)}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
    return h.hexdigest()[:16]


def _check_text(path: Path, sample: int = 1 << 16) -> None:
    """Refuse a file that is not UTF-8 text before tokenizing it (read leniently, a binary or
    Latin-1 file would train silently on replacement characters)."""
    with open(path, "rb") as f:
        head = f.read(sample)
    if b"\x00" in head:
        raise ConfigError(
            "data.source",
            f"{path} looks binary (NUL bytes); give a text/JSONL/Parquet file, or a nanoGPT "
            ".bin token file with the .bin suffix",
        )
    try:
        head.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        if e.start < len(head) - 3:  # not merely a character cut by the sample's end
            raise ConfigError(
                "data.source",
                f"{path} is not UTF-8 (byte {e.start}); convert it, e.g. iconv -f latin1 -t utf-8",
            ) from None


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def is_saved_dataset(path: Path) -> bool:
    return path.is_dir() and any(
        (path / marker).is_file() for marker in ("dataset_dict.json", "state.json")
    )


def open_source(source: str, *, val_fraction: float, split: str = "") -> Source:
    """Resolve `data.source` to a Source, or raise ConfigError if it is missing or unusable."""
    if source == "stdlib":
        root = stdlib_root()
        files = _list_text_files(root, "stdlib")
        if not files:
            raise ConfigError("data.source", f"no standard-library sources found under {root}")
        return Source("stdlib", root, f"stdlib-{_fingerprint(files, root)}", val_fraction)
    path = Path(source).expanduser()
    if not path.exists():
        raise ConfigError(
            "data.source",
            f"{source!r} does not exist; give a text/JSONL/JSON/Parquet/.bin file, a folder, "
            "or 'stdlib'",
        )
    path = path.resolve()
    if path.is_dir():
        return _open_folder(path, val_fraction, split)
    suffix = path.suffix.lower()
    if suffix == ".parquet":
        return Source("parquet", path, f"parquet-{_fingerprint([path], path.parent)}", val_fraction)
    _check_text(path)
    kind = {".jsonl": "jsonl", ".json": _json_kind(path)}.get(suffix, "text")
    return Source(kind, path, f"{kind}-{_fingerprint([path], path.parent)}", val_fraction)


def _json_kind(path: Path) -> str:
    """A .json file holds an array of records, or (as before) one object per line."""
    with open(path, encoding="utf-8-sig") as fh:
        head = fh.read(4096).lstrip()
    return "json" if head.startswith("[") else "jsonl"


def _open_folder(path: Path, val_fraction: float, split: str) -> Source:
    if is_saved_dataset(path):
        files = sorted(f for f in path.rglob("*") if f.is_file())
        key = f"arrow-{_fingerprint(files, path)}-{split or 'train'}"
        return Source("arrow", path, key, val_fraction, split)
    parquet = sorted(path.glob("*.parquet"))
    if parquet:
        return Source("parquet", path, f"parquet-{_fingerprint(parquet, path)}", val_fraction)
    files = _list_text_files(path, "folder")
    if not files:
        raise ConfigError(
            "data.source",
            f"folder {str(path)!r} holds no text files "
            f"({', '.join(sorted(TEXT_SUFFIXES - {''}))}), Parquet files or saved dataset",
        )
    for f in files:  # each as a single file is checked: binary or not UTF-8 is refused
        _check_text(f)
    return Source("folder", path, f"folder-{_fingerprint(files, path)}", val_fraction)
