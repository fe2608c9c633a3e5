"""What offloading costs per step: the same run with and without each offload tier.

On a CPU the "device" and the host are the same memory, so nothing is saved there: what this
measures is the machinery's overhead (gradient hooks, host accumulation, the copies back), the
floor of what offloading costs on a GPU, where the copies cross the host link instead. Each row
is `onegpu train` in a fresh process (`onegpu bench`'s row runner: median steady step), rounds
interleaved; ratios against the row without offload of the same round set.

Usage: python benchmarks/offload.py [--preset small] [--rounds 3] [--steps 12] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import tempfile
from pathlib import Path

import torch

from onegpu.tools.bench import run_row

ROWS = {
    "on device": {},
    "optimizer in host memory": {"memory.offload_optimizer": "true"},
    "optimizer in host memory, accumulation x4": {"memory.offload_optimizer": "true",
                                                  "train.micro_batch_size": "/4"},
    "on device, accumulation x4": {"train.micro_batch_size": "/4"},
    "weights, gradients and optimizer in host memory (FSDP2 CPU offload, one process)":
        {"memory.offload_params": "true"},
    "optimizer states and weight copies on disk (memory.offload_dir)":
        {"memory.offload_optimizer": "true", "memory.offload_dir": "{disk}"},
}  # fmt: skip


def disk_rates(folder: Path, nbytes: int = 2**30) -> dict[str, float]:
    """This disk's rates for the disk tier's files: writing a memory-mapped file and flushing
    it (fsync), then reading it back with its pages dropped from the page cache first
    (posix_fadvise DONTNEED), so the read comes from the disk, not from RAM."""
    import os
    import time

    path = folder / "rate.bin"
    t = torch.from_file(str(path), shared=True, size=nbytes // 4, dtype=torch.float32)
    t0 = time.perf_counter()
    t.fill_(1.0)
    fd = os.open(path, os.O_RDONLY)
    os.fsync(fd)
    write = nbytes / (time.perf_counter() - t0)
    del t
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    os.close(fd)
    t = torch.from_file(str(path), shared=True, size=nbytes // 4, dtype=torch.float32)
    t0 = time.perf_counter()
    total = float(t.sum())
    read = nbytes / (time.perf_counter() - t0)
    assert total == nbytes // 4
    del t
    path.unlink()
    return {"write_bytes_per_s": write, "read_bytes_per_s": read, "bytes": nbytes}


def _isa() -> str:
    flags = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    return "AVX512-BF16" if "avx512_bf16" in flags else "AVX2 (no native bf16)"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--preset", default="small")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--disk-dir", default="", help="folder on the disk to measure (default: a "
                    "temporary folder, usually /tmp)")  # fmt: skip
    a = ap.parse_args()
    from onegpu.config import load_config

    batch = load_config(a.preset).train.batch_size
    base = {"train.device": "cpu", "memory.loss_chunk": "0", "train.compile": "none",
            "train.micro_batch_size": str(batch)}  # fmt: skip
    results: dict[str, list[dict]] = {name: [] for name in ROWS}
    with tempfile.TemporaryDirectory() as work:
        for r in range(a.rounds):
            names = list(ROWS) if r % 2 == 0 else list(reversed(ROWS))
            for name in names:
                over = {**base, **ROWS[name]}
                if over.get("memory.offload_dir") == "{disk}":
                    over["memory.offload_dir"] = str(Path(a.disk_dir or work) / "tier")
                if over["train.micro_batch_size"].startswith("/"):
                    over["train.micro_batch_size"] = str(
                        batch // int(over["train.micro_batch_size"][1:])
                    )
                res = run_row(a.preset, None, over, a.steps, Path(work))
                results[name].append(res)
                print(f"round {r + 1} {name}: {res['tokens_per_s']:,.0f} tokens/s, "
                      f"peak RSS {res['peak_rss_bytes'] / 2**20:,.0f} MiB", flush=True)  # fmt: skip
        rates = disk_rates(Path(a.disk_dir or work))
    rows = []
    for name, runs in results.items():
        tok = statistics.median(x["tokens_per_s"] for x in runs)
        rss = statistics.median(x["peak_rss_bytes"] for x in runs)
        rows.append({"row": name, "tokens_per_s": tok, "peak_rss_bytes": rss,
                     "rounds": [x["tokens_per_s"] for x in runs], "precision": runs[0]["precision"]})  # fmt: skip
    ref = {r["row"]: r["tokens_per_s"] for r in rows}
    for r in rows:
        plain = "on device, accumulation x4" if "x4" in r["row"] else "on device"
        r["vs_on_device"] = r["tokens_per_s"] / ref[plain]
    cpu = subprocess.run(["sh", "-c", "grep -m1 'model name' /proc/cpuinfo | cut -d: -f2"],
                         capture_output=True, text=True).stdout.strip()  # fmt: skip
    command = (
        f"python benchmarks/offload.py --preset {a.preset} --rounds {a.rounds} --steps {a.steps}"
    )
    lines = [
        f"# Offload overhead on this CPU ({a.preset}, {rows[0]['precision']})",
        "",
        f"`{command}`: {cpu}, {_isa()}, {torch.get_num_threads()} threads, torch "
        f"{torch.__version__}, {platform.platform()}. Fresh process per row, {a.rounds} "
        "interleaved rounds, median steady step. On a CPU nothing is saved (one memory): "
        "the ratio is the machinery's overhead.",
        "",
        "| configuration | tokens/s | x on device | peak RSS |",
        "|---|---|---|---|",
        *(f"| {r['row']} | {r['tokens_per_s']:,.0f} | {r['vs_on_device']:.3f} | "
          f"{r['peak_rss_bytes'] / 2**20:,.0f} MiB |" for r in rows),
        "",
        f"Disk tier's files on this disk ({rates['bytes'] / 2**30:.0f} GiB memory-mapped): write + "
        f"fsync {rates['write_bytes_per_s'] / 1e9:,.2f} GB/s, read with the page cache dropped "
        f"{rates['read_bytes_per_s'] / 1e9:,.2f} GB/s.",
        "",
    ]  # fmt: skip
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"offload-{a.preset}.md").write_text("\n".join(lines))
    (out / f"offload-{a.preset}.json").write_text(
        json.dumps({"command": command, "rows": rows, "disk": rates}, indent=1) + "\n"
    )
    print("\n".join(lines))


if __name__ == "__main__":
    main()
