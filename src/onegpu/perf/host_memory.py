"""This machine's memory, without torch: what the start-up checks of both backends compare a
planned step with."""

from __future__ import annotations

import os
from pathlib import Path


def machine_ram() -> int:
    """Physical memory in bytes (the default --host-memory of a plan)."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def available_host_bytes() -> int:
    """MemAvailable from /proc/meminfo (what can be allocated without swapping), else RAM."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return machine_ram()
