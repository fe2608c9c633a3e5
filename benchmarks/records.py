"""What every benchmark's result file needs: which bf16 kind the CPU has (every result names
it) and a name of its own (a result file is a record: a rerun writes beside it, never over it)."""

from __future__ import annotations

import datetime
import json
import subprocess
from pathlib import Path

from onegpu.perf.cpu import read_cpuinfo

RESULTS = Path(__file__).parent / "results"


def bf16_kind() -> str:
    """'amx_bf16', 'avx512_bf16' (both where both are), or 'avx2 only' (bf16 emulated)."""
    flags = set(read_cpuinfo().get("flags", "").split())
    return " ".join(f for f in ("amx_bf16", "avx512_bf16") if f in flags) or "avx2 only"


def new_result_file(stem: str) -> Path:
    """results/<stem>-<date>.md, or -2, -3, ... after it where that exists already."""
    today = datetime.date.today()
    out = RESULTS / f"{stem}-{today}.md"
    n = 2
    while out.exists():
        out = RESULTS / f"{stem}-{today}-{n}.md"
        n += 1
    return out


def write_result(stem: str, lines: list[str], *, show: bool = False) -> Path:
    """`lines` as a new results/<stem>-<date>.md (`show`: printed too); says where it went."""
    out = new_result_file(stem)
    out.write_text("\n".join(lines) + "\n")
    if show:
        print("\n".join(lines))
    print(f"wrote {out}")
    return out


def write_table(
    stem: str, head: str, columns: list[str], cells: list[list[str]], record: dict
) -> Path:
    """`head`, then a table of `cells` under `columns`, as a new results/<stem>-<date>.md, and
    `record` (the command and the raw rows) beside it as .json; says where it went."""
    out = new_result_file(stem)
    table = ["| " + " | ".join(columns) + " |", "|---" * len(columns) + "|"]
    table += ["| " + " | ".join(row) + " |" for row in cells]
    out.write_text(head + "\n".join(table) + "\n")
    out.with_suffix(".json").write_text(json.dumps(record, indent=1))
    print(f"wrote {out}")
    return out


def commit_of(src: Path) -> str:
    """The commit of the checkout `src` is in (with '+changes' where its tree, or the package's
    source beside it, differs)."""
    git = ["git", "-C", str(src)]
    head = subprocess.run([*git, "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    dirty = subprocess.run(
        [*git, "status", "--porcelain", "--", ".", ":/src"], capture_output=True, text=True
    )
    return head.stdout.strip() + ("+changes" if dirty.stdout.strip() else "")
