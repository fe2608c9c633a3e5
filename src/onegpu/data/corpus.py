"""Where text comes from: the embedded default corpus and user files, split into train/val.

The default corpus is the running Python's standard-library source (real text on every machine,
no download). Every source yields documents in a deterministic order and assigns each document
to train or validation by a stable hash of its name, so the split never depends on file-system
order and train and validation never share a document.
"""

from __future__ import annotations

import hashlib
import json
import sysconfig
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from onegpu.config import ConfigError

TEXT_SUFFIXES = {".txt", ".md", ".rst", ".py", ".text", ""}
# Not part of the standard library proper (site-packages), or test data that dwarfs it.
STDLIB_SKIP_DIRS = {"site-packages", "dist-packages", "__pycache__", "test", "tests", "idle_test"}


@dataclass(frozen=True, slots=True)
class Corpus:
    """A text source: `key` changes whenever its content may have changed (for caching)."""

    kind: str  # "stdlib" | "text" | "folder" | "jsonl"
    path: Path
    key: str
    val_fraction: float
    text_field: str = "text"

    def documents(self, split: str) -> Iterator[str]:
        """The documents of one split ('train' or 'val'), in a fixed order."""
        assert split in ("train", "val")
        if self.kind == "text":
            yield from _split_single_text(self.path, self.val_fraction, split)
            return
        for name, text in self._named_documents():
            if _in_val(name, self.val_fraction) == (split == "val"):
                yield text

    def _named_documents(self) -> Iterator[tuple[str, str]]:
        if self.kind in ("stdlib", "folder"):
            for f in _list_files(self.path, stdlib=self.kind == "stdlib"):
                yield str(f.relative_to(self.path)), f.read_text(encoding="utf-8", errors="replace")
        elif self.kind == "jsonl":
            with open(self.path, encoding="utf-8") as fh:
                for lineno, line in enumerate(fh, 1):
                    if not line.strip():
                        continue
                    try:
                        record = json.loads(line)
                    except json.JSONDecodeError as e:
                        raise ConfigError(
                            "data.source", f"{self.path}:{lineno} is not valid JSON ({e})"
                        ) from None
                    if not isinstance(record, dict):
                        raise ConfigError(
                            "data.source",
                            f"line {lineno} of {self.path} is a JSON {type(record).__name__}, not "
                            'an object: give JSON Lines, one {"text": "..."} object per line '
                            "(or a .txt file)",
                        )
                    text = record.get(self.text_field)
                    if not isinstance(text, str):
                        raise ConfigError(
                            "data.text_field",
                            f"record {lineno} of {self.path} has no string field {self.text_field!r}; "
                            "set --data.text_field to the field that holds the text",
                        )
                    yield f"record-{lineno}", text


def _in_val(name: str, val_fraction: float) -> bool:
    digest = hashlib.sha1(name.encode()).digest()
    return int.from_bytes(digest[:4], "big") / 2**32 < val_fraction


def _split_single_text(path: Path, val_fraction: float, split: str) -> Iterator[str]:
    text = path.read_text(encoding="utf-8-sig", errors="replace")
    cut = len(text) - int(len(text) * val_fraction)
    nl = text.find("\n", cut)  # cut at a line boundary
    cut = nl + 1 if nl != -1 and val_fraction > 0 else cut
    yield text[:cut] if split == "train" else text[cut:]


def _list_files(root: Path, *, stdlib: bool) -> list[Path]:
    files = []
    for f in sorted(root.rglob("*")):
        rel_parts = f.relative_to(root).parts
        if any(p.startswith(".") for p in rel_parts) or not f.is_file():
            continue
        if stdlib:
            if f.suffix != ".py" or STDLIB_SKIP_DIRS.intersection(rel_parts[:-1]):
                continue
        elif f.suffix.lower() not in TEXT_SUFFIXES:
            continue
        files.append(f)
    return files


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
            f"{path} looks binary (NUL bytes); give a text/JSONL file, or a nanoGPT .bin token "
            "file with the .bin suffix",
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


def open_corpus(source: str, *, val_fraction: float, text_field: str = "text") -> Corpus:
    """Resolve `data.source` to a Corpus, or raise ConfigError if it is missing or unusable."""
    if source == "stdlib":
        root = stdlib_root()
        files = _list_files(root, stdlib=True)
        if not files:
            raise ConfigError("data.source", f"no standard-library sources found under {root}")
        return Corpus("stdlib", root, f"stdlib-{_fingerprint(files, root)}", val_fraction)
    path = Path(source).expanduser()
    if not path.exists():
        raise ConfigError(
            "data.source",
            f"{source!r} does not exist; give a text/JSONL/.bin file, a folder, or 'stdlib'",
        )
    if path.is_dir():
        files = _list_files(path, stdlib=False)
        if not files:
            raise ConfigError(
                "data.source",
                f"folder {source!r} holds no text files ({', '.join(sorted(TEXT_SUFFIXES - {''}))})",
            )
        for f in files:  # each as a single file is checked: binary or not UTF-8 is refused
            _check_text(f)
        return Corpus("folder", path.resolve(), f"folder-{_fingerprint(files, path)}", val_fraction)
    _check_text(path)
    if path.suffix.lower() in (".jsonl", ".json"):
        key = f"jsonl-{_fingerprint([path], path.parent)}-{text_field}"
        return Corpus("jsonl", path.resolve(), key, val_fraction, text_field)
    return Corpus("text", path.resolve(), f"text-{_fingerprint([path], path.parent)}", val_fraction)
