"""The run folder contract (docs/architecture.md): config.toml, metrics.jsonl, summary.json,
checkpoints/. No framework import: every backend writes the same folder."""

from __future__ import annotations

import contextlib
import json
import os
import platform
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import onegpu
from onegpu.config import Config, ConfigError, ModelConfig, OutConfig, to_toml
from onegpu.runs.atomic import atomic_path, copy_atomic, write_text_atomic
from onegpu.runs.lock import LOCK_NAME, hold_run_folder
from onegpu.runs.sinks import JsonlSink, TensorBoardSink, strict

RUN_FILES = ("config.toml", "metrics.jsonl", "summary.json")
# A model.hf folder's files other than weights, kept in the run folder's model/
MODEL_FOLDER_FILES = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
)
CHAT_TEMPLATE = "chat_template.jinja"
"""The chat template a run's chat data was rendered with (transformers' file name)."""


class RunFolderWriteError(OSError):
    """An OSError on a file of the run folder while the run trains (a checkpoint, the metrics,
    the summary: a full disk, a folder made read-only). Every save is all-or-nothing, so what
    was saved before is intact and `--train.resume auto` continues once the cause is fixed;
    other OSErrors (the data, the cache, another command's files) are not this."""


@contextlib.contextmanager
def writes_of(out_dir: Path) -> Iterator[None]:
    """Inside: an OSError naming a file under `out_dir` is raised as RunFolderWriteError."""
    try:
        yield
    except RunFolderWriteError:
        raise
    except OSError as e:
        if not any(_inside(name, out_dir) for name in (e.filename, e.filename2)):
            raise
        raise RunFolderWriteError(e.errno, e.strerror or str(e), e.filename) from e


def _inside(name: Any, folder: Path) -> bool:
    if not isinstance(name, (str, os.PathLike)):
        return False
    return Path(os.path.abspath(name)).is_relative_to(os.path.abspath(folder))


def resolve_out_dir(out: OutConfig, *, resuming: bool = False) -> Path:
    """Check the folder before anything runs: an existing run is never overwritten by accident
    (a resumed run continues in its own folder)."""
    path = Path(out.dir) if out.dir else Path("runs") / time.strftime("%Y%m%d-%H%M%S")
    if path.exists() and not path.is_dir():
        raise ConfigError("out.dir", f"{path} exists and is not a folder; pick a new folder")
    occupied = path.is_dir() and any(p.name != LOCK_NAME for p in path.iterdir())
    if occupied and not (out.overwrite or resuming):
        raise ConfigError(
            "out.dir",
            f"{path} is not empty; pick a new folder, continue it with --train.resume auto, "
            "or replace it with --out.overwrite true",
        )
    check_writable(path, "out.dir")
    hold_run_folder(path)  # one writer: a second run into this folder exits 2 from here on
    return path


def check_writable(folder: Path, field: str) -> None:
    """ConfigError naming `field` unless a file can be created in `folder`. Folders made for the
    test are removed again: a run refused later leaves nothing behind. Two runs started together
    into one new folder race here (one makes it while the other probes, or removes it): a
    folder that appears or vanishes under the probe is tried again, not reported unwritable."""
    for attempt in range(5):
        try:
            _probe(folder)
            return
        except (FileExistsError, FileNotFoundError) as e:
            if attempt == 4:
                error = e
        except OSError as e:
            error = e
            break
    raise ConfigError(
        field, f"cannot write in {folder} ({error.strerror}); pick a folder you can write to"
    ) from None


def _probe(folder: Path) -> None:
    made: list[Path] = []
    try:
        missing = [p for p in (folder, *folder.parents) if not p.exists()]
        for p in reversed(missing):
            p.mkdir()
            made.append(p)
        probe = folder / f".onegpu-write-test.{os.getpid()}"
        probe.write_bytes(b"")
        probe.unlink()
    finally:
        for p in reversed(made):
            with contextlib.suppress(OSError):  # another run may have filled it meanwhile
                p.rmdir()


def _git_commit() -> str | None:
    try:
        here = Path(__file__).resolve().parent
        out = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=here, capture_output=True, text=True, timeout=5
        )
        return out.stdout.strip() or None if out.returncode == 0 else None
    except (OSError, subprocess.SubprocessError):
        return None


def environment(**backend: Any) -> dict[str, Any]:
    """Code, library and hardware versions, written into every run (modded-nanogpt does);
    `backend` adds the framework's own (version, threads, allocator)."""
    return {
        "onegpu": onegpu.__version__,
        "git_commit": _git_commit(),
        **backend,
        "python": platform.python_version(),
        "platform": platform.platform(),
    }


class RunFolder:
    """Opened once the run has started (built, data ready): only then is an old run replaced.

    `resume_step`: continue the run in the folder from that step: metric rows after it are
    dropped (they belong to steps about to be redone), the rest is kept. Under torchrun only
    rank 0 writes (`main`); the others know the paths (they write checkpoint shards) and
    nothing else."""

    def __init__(
        self, path: Path, cfg: Config, *, resume_step: int | None = None, main: bool = True
    ):
        self.path = path
        self.checkpoints = path / "checkpoints"
        self.main = main
        self._metrics = None
        self._tensorboard = None
        if not main:
            return
        path.mkdir(parents=True, exist_ok=True)
        if resume_step is None:  # a new run (overwrite=true: the old one goes, checkpoints too)
            for name in (*RUN_FILES, "model.safetensors"):
                (path / name).unlink(missing_ok=True)
            shutil.rmtree(self.checkpoints, ignore_errors=True)
        else:
            self._truncate_metrics(resume_step)
        self.checkpoints.mkdir(exist_ok=True)
        write_text_atomic(path / "config.toml", to_toml(cfg))
        self._metrics = JsonlSink(path / "metrics.jsonl")
        self._tensorboard = TensorBoardSink(path / "tensorboard") if cfg.out.tensorboard else None

    def write_model_files(
        self, m: ModelConfig, tokenizer: Any | None, chat_template: str | None = None
    ) -> None:
        """What export and generate need besides the weights, so that they work after the
        model folder or the token cache is gone: `model/` holds a model.hf folder's
        config and tokenizer files; `tokenizer.json` the data's tokenizer (with its
        end-of-text id in `tokenizer_eot.txt`); `chat_template.jinja` the template chat
        data was rendered with."""
        if not self.main:
            return
        if m.hf:
            target = self.path / "model"
            target.mkdir(exist_ok=True)
            for name in MODEL_FOLDER_FILES:
                src = Path(m.hf).expanduser() / name
                if src.is_file():
                    copy_atomic(src, target / name)
        if tokenizer is not None and hasattr(tokenizer, "to_tokenizers"):
            with atomic_path(self.path / "tokenizer.json") as tmp:
                tokenizer.to_tokenizers().save(str(tmp))
            write_text_atomic(self.path / "tokenizer_eot.txt", f"{tokenizer.eot_id}\n")
        if chat_template is not None:
            write_text_atomic(self.path / CHAT_TEMPLATE, chat_template)

    def _truncate_metrics(self, step: int) -> None:
        path = self.path / "metrics.jsonl"
        if not path.exists():
            return
        kept = []
        for line in path.read_text().splitlines():
            try:
                if json.loads(line)["step"] <= step:
                    kept.append(line)
            except (ValueError, KeyError, TypeError):
                break  # a line cut short by a kill: nothing after it is trusted
        tmp = path.with_name(f"metrics.jsonl.tmp{os.getpid()}")
        tmp.write_text("".join(f"{line}\n" for line in kept))
        os.replace(tmp, path)

    def log(self, row: dict[str, Any]) -> None:
        if not self.main:
            return
        self._metrics.log(row)
        if self._tensorboard is not None:
            self._tensorboard.log(row)

    def read_summary(self) -> dict[str, Any] | None:
        """summary.json as written (None if missing or unreadable)."""
        try:
            return json.loads((self.path / "summary.json").read_text())
        except (OSError, ValueError):
            return None

    def write_summary(self, summary: dict[str, Any]) -> None:
        if not self.main:
            return
        tmp = self.path / f"summary.json.tmp{os.getpid()}"
        tmp.write_text(json.dumps(strict(summary), indent=1, allow_nan=False) + "\n")
        os.replace(tmp, self.path / "summary.json")

    def close(self) -> None:
        if self._metrics is not None:
            self._metrics.close()
        if self._tensorboard is not None:
            self._tensorboard.close()
