"""The run folder contract (docs/architecture.md): config.toml, metrics.jsonl, summary.json, checkpoints/."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import time
from pathlib import Path
from typing import Any

import torch

import onegpu
from onegpu.config import Config, ConfigError, OutConfig, to_toml
from onegpu.perf.allocator import active_allocator

RUN_FILES = ("config.toml", "metrics.jsonl", "summary.json")


def resolve_out_dir(out: OutConfig) -> Path:
    """Check the folder before anything runs: an existing run is never overwritten by accident."""
    path = Path(out.dir) if out.dir else Path("runs") / time.strftime("%Y%m%d-%H%M%S")
    if path.exists() and not path.is_dir():
        raise ConfigError("out.dir", f"{path} exists and is not a folder; pick a new folder")
    if path.is_dir() and any(path.iterdir()) and not out.overwrite:
        raise ConfigError(
            "out.dir", f"{path} is not empty; pick a new folder or pass --out.overwrite true"
        )
    return path


def _git_commit() -> str | None:
    try:
        here = Path(__file__).resolve().parent
        out = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=here, capture_output=True, text=True, timeout=5
        )
        return out.stdout.strip() or None if out.returncode == 0 else None
    except (OSError, subprocess.SubprocessError):
        return None


def environment() -> dict[str, Any]:
    """Code, library and hardware versions, written into every run (modded-nanogpt does)."""
    return {
        "onegpu": onegpu.__version__,
        "git_commit": _git_commit(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "threads": torch.get_num_threads(),
        "allocator": active_allocator(),
    }


class RunFolder:
    def __init__(self, path: Path, cfg: Config):
        self.path = path
        path.mkdir(parents=True, exist_ok=True)
        (path / "checkpoints").mkdir(exist_ok=True)
        for name in RUN_FILES:  # overwrite=true: start the files afresh
            (path / name).unlink(missing_ok=True)
        (path / "config.toml").write_text(to_toml(cfg))
        self._metrics = open(path / "metrics.jsonl", "a", buffering=1)  # noqa: SIM115 (closed in close())

    def log(self, row: dict[str, Any]) -> None:
        self._metrics.write(json.dumps(row) + "\n")

    def write_summary(self, summary: dict[str, Any]) -> None:
        tmp = self.path / f"summary.json.tmp{os.getpid()}"
        tmp.write_text(json.dumps(summary, indent=1) + "\n")
        os.replace(tmp, self.path / "summary.json")

    def close(self) -> None:
        self._metrics.close()
