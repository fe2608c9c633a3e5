"""What torchrun tells a process through its environment, read in this one place (the
process group, the CLI and the backends' checks ask here)."""

from __future__ import annotations

import os


def world_size_from_env() -> int:
    """Processes of the job (1 outside torchrun)."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def rank_from_env() -> int:
    return int(os.environ.get("RANK", "0"))


def local_rank_from_env() -> int:
    return int(os.environ.get("LOCAL_RANK", "0"))


def local_world_size_from_env() -> int:
    """Processes of the job on this machine (1 outside torchrun)."""
    return int(os.environ.get("LOCAL_WORLD_SIZE", "1"))


def launched_by_torchrun() -> bool:
    """torchrun gave this process a rendezvous address."""
    return "MASTER_ADDR" in os.environ


def restart_count() -> str | None:
    """torchrun's restart attempt of this job (None outside torchrun)."""
    return os.environ.get("TORCHELASTIC_RESTART_COUNT")


def error_file() -> str | None:
    """Where torchrun wants a failed process's error written."""
    return os.environ.get("TORCHELASTIC_ERROR_FILE")
