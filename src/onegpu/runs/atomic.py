"""Folders and files a user keeps (an export; bench, tune, plot and profile results; a run's
config and tokenizer) written whole or not at all.

A file is written under a temporary name beside it (same suffix, so writers that go by the
extension still work), fsynced and renamed onto its name: `atomic_path`, `write_text_atomic`.

A folder is written under a temporary name beside its destination, then renamed into place;
an existing folder is first renamed aside and removed once the new one is in place. A kill
between the two renames leaves the old folder under its aside name: `recover` puts it back
the next time the same destination is written. So at any moment the destination holds the
old folder or the new one, never a mix of both.

Files that belong together in a folder of other things (bench.json, bench.md and bench.png;
best.toml and tune.*) are written by `write_together`: every one under its temporary name
first, then a journal of the renames, then the renames, then the journal goes. A kill during
the renames leaves the journal: `finish_together` (run by the next writer, and by readers that
care) completes them, so the set is the old one or, once finished, the new one.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path

_TMP, _OLD = ".onegpu-tmp-", ".onegpu-old-"


def file_mode() -> int:
    """The mode a plain `open()` gives a new file under this process's umask (0644 usually):
    writers that create files privately (safetensors: 0600) are brought in line with it."""
    mask = os.umask(0)
    os.umask(mask)
    return 0o666 & ~mask


def _aside(dest: Path, kind: str) -> Path:
    return dest.with_name(f"{kind}{dest.name}.{os.getpid()}")


def recover(dest: Path) -> None:
    """Undo what a killed writer of `dest` left: its half-written folder goes; its renamed-aside
    old folder comes back if `dest` is missing."""
    parent = dest.parent
    if not parent.is_dir():
        return
    for p in parent.glob(f"{_TMP}{dest.name}.*"):
        shutil.rmtree(p, ignore_errors=True)
    olds = sorted(parent.glob(f"{_OLD}{dest.name}.*"))
    for p in olds:
        if not dest.exists():
            os.rename(p, dest)
        else:
            shutil.rmtree(p, ignore_errors=True)


@contextlib.contextmanager
def atomic_path(path: Path) -> Iterator[Path]:
    """A temporary path beside `path` to write to: renamed onto `path` when the block ends
    (after an fsync, with the umask's mode), removed if it raises."""
    path = Path(path)
    tmp = path.with_name(f"{_TMP}{os.getpid()}-{path.name}")
    try:
        yield tmp
        os.chmod(tmp, file_mode())
        with open(tmp, "rb") as fh:
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def write_text_atomic(path: Path, text: str) -> None:
    with atomic_path(path) as tmp:
        tmp.write_text(text)


def copy_atomic(src: Path, dest: Path) -> None:
    with atomic_path(dest) as tmp:
        shutil.copyfile(src, tmp)


@contextlib.contextmanager
def staging(dest: Path) -> Iterator[Path]:
    """A temporary folder beside `dest`; on success it becomes `dest` (replacing what was
    there), on failure it goes and `dest` is untouched."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = _aside(dest, _TMP)
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        yield tmp
        for f in tmp.iterdir():  # on disk before the rename makes them visible
            if f.is_file():
                os.chmod(f, file_mode())
                with open(f, "rb") as fh:
                    os.fsync(fh.fileno())
        old = _aside(dest, _OLD)
        if dest.exists():
            os.rename(dest, old)
        os.rename(tmp, dest)
        shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


JOURNAL = ".onegpu-renames.json"


def write_together(folder: Path, files: Mapping[str, str | Callable[[Path], None]]) -> None:
    """Write `files` (name -> text, or a function writing to the path it is given) into
    `folder` as one set: the old set or the new one, never a mix."""
    folder.mkdir(parents=True, exist_ok=True)
    finish_together(folder)
    pairs: list[tuple[str, str]] = []
    try:
        for name, content in files.items():
            tmp = folder / f"{_TMP}{os.getpid()}-{name}"
            pairs.append((tmp.name, name))
            if isinstance(content, str):
                tmp.write_text(content)
            else:
                content(tmp)
            os.chmod(tmp, file_mode())
            with open(tmp, "rb") as fh:
                os.fsync(fh.fileno())
        write_text_atomic(folder / JOURNAL, json.dumps(pairs))
    except BaseException:
        for tmp_name, _ in pairs:
            (folder / tmp_name).unlink(missing_ok=True)
        raise
    finish_together(folder)


def finish_together(folder: Path) -> None:
    """Complete the renames of a `write_together` that was cut short after its journal."""
    journal = folder / JOURNAL
    if not journal.is_file():
        return
    for tmp_name, name in json.loads(journal.read_text()):
        if (folder / tmp_name).exists():
            os.replace(folder / tmp_name, folder / name)
    _fsync_dir(folder)
    journal.unlink()


def _fsync_dir(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
