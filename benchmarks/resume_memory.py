"""What a resume costs in host memory: a fresh run against the same run resumed from its
checkpoint, on a 110M-parameter GPT (8 x d1024, vocabulary 8,192, fp32 AdamW: a 1.3 GB
checkpoint) on the CPU.

Each run is a fresh `onegpu train` process with a probe around the restore that reads
/proc/self/status: the peak resident set (VmHWM), and the resident set split into anonymous
memory (what the process allocated) and file pages (mapped files: the libraries, and a mapped
checkpoint, which the kernel may reclaim) after the restore and at the end.

    python benchmarks/resume_memory.py [--src DIR]   (--src: another checkout's src/, to
                                                      measure the code before a change)

Writes benchmarks/results/resume-memory-<date>.md (a new file each run).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
from records import bf16_kind, commit_of, write_result

from onegpu.perf.devices import cpu_name

ARGS = ["--preset", "tiny", "--model.n_layer", "8", "--model.d_model", "1024",
        "--model.n_head", "8", "--model.vocab_size", "8192", "--model.seq_len", "64",
        "--data.seq_len", "64", "--train.batch_size", "2", "--train.micro_batch_size", "2",
        "--train.precision", "fp32", "--train.compile", "none", "--train.eval_every", "0",
        "--train.device", "cpu", "--out.progress", "false", "--checkpoint.every", "2"]  # fmt: skip
PROBE = """
import json, sys
import onegpu.cli
import onegpu.runs.lifecycle as lifecycle

def status(when):
    fields = dict(line.split(":", 1) for line in open("/proc/self/status"))
    kib = {k: int(fields[k].split()[0]) for k in ("VmHWM", "VmRSS", "RssAnon", "RssFile")}
    print("PROBE " + json.dumps({"when": when, **kib}), flush=True)

restore = lifecycle._restore

def probed(*args):
    status("before restore")
    restore(*args)
    status("after restore")

lifecycle._restore = probed
try:
    onegpu.cli.main(sys.argv[1:])
finally:
    status("end")
"""
MIB = 1024  # the probe's figures are KiB


def run(out: Path, steps: int, resume: bool, src: str | None) -> dict[str, dict[str, int]]:
    """The probe's readings of one `onegpu train` process, by moment."""
    env = {**os.environ}
    if src:
        env["PYTHONPATH"] = src
    cmd = [sys.executable, "-c", PROBE, "train", *ARGS, "--out", str(out),
           "--train.max_steps", str(steps)]  # fmt: skip
    if resume:
        cmd += ["--train.resume", "auto"]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True)
    readings = [
        json.loads(line[6:]) for line in done.stdout.splitlines() if line.startswith("PROBE ")
    ]
    return {r.pop("when"): r for r in readings}


def _mib(kib: int) -> str:
    return f"{kib / MIB:,.0f}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--src", help="another checkout's src/ (the code before a change)")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "run"
        fresh = run(folder, 2, resume=False, src=args.src)
        resumed = run(folder, 4, resume=True, src=args.src)
    rows = [
        "| run | peak RSS (VmHWM) MiB | after the restore: anonymous / file MiB "
        "| at the end: anonymous / file MiB |",
        "|---|---|---|---|",
        f"| fresh, 2 steps | {_mib(fresh['end']['VmHWM'])} | - "
        f"| {_mib(fresh['end']['RssAnon'])} / {_mib(fresh['end']['RssFile'])} |",
    ]
    after, end = resumed["after restore"], resumed["end"]
    rows.append(
        f"| resumed at step 2, 2 more steps | {_mib(end['VmHWM'])} "
        f"| {_mib(after['RssAnon'])} / {_mib(after['RssFile'])} "
        f"| {_mib(end['RssAnon'])} / {_mib(end['RssFile'])} |"
    )
    code = commit_of(Path(args.src) if args.src else Path(__file__).parents[1] / "src")
    lines = [
        "# Host memory of a resume (CPU)",
        "",
        f"Machine: {cpu_name()} ({bf16_kind()}), {torch.get_num_threads()} threads, torch "
        f"{torch.__version__}. Code: onegpu at commit {code}. Command: "
        "`python benchmarks/resume_memory.py [--src OTHER_CHECKOUT/src]`. "
        "A 110M-parameter GPT (8 x d1024, vocabulary 8,192), fp32 AdamW: "
        "a 1.3 GB checkpoint at step 2.",
        "",
        *rows,
        "",
        "Anonymous: memory the process allocated. File: mapped pages (the libraries, and a "
        "mapped checkpoint), which count in the resident set but are page cache "
        "the kernel reclaims when memory is short.",
    ]
    write_result("resume-memory", lines, show=True)


if __name__ == "__main__":
    main()
