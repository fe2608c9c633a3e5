"""A hostile week in minutes: kill every writer of a kept file at random moments, start two runs
into one folder, fill the disk during a save, change the data before a resume.

Each scenario reports counts; every check must hold for the script to exit 0.

- export / plot / bench / tune: the command is SIGKILLed at a random moment (uniform over its
  usual running time), `n` times. After each kill, what the next writer does first runs
  (`recover` for a folder, `finish_together` for a set of files); then the destination must be
  absent, the old version or a new one: every file parses whole (JSON, TOML, PNG to its IEND),
  an export's config and weights agree, and no temporary name is left.
- concurrent: two `onegpu train --out SAME` started together: one trains, the other exits 2
  naming the holder's PID (or, where it started only once the first had finished, refused
  because the folder holds a run), every time.
- disk-full: a run checkpointing every step into a small tmpfs (mounted here; skipped with the
  reason where this process may not mount) exits 1 with one line; the tmpfs is enlarged and
  `--train.resume auto` ends on the uninterrupted run's losses.
- data-changed: text appended to the `--data.source` file before `--train.resume auto`: exit 2
  naming data.source; `--train.resume_new_data true` continues.

Usage: python benchmarks/fault_test.py [--kills 10] [--only export,plot,...] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import tomllib

TINY = ["--preset", "tiny", "--train.device", "cpu", "--out.progress", "false",
        "--train.measure_memory", "false"]  # fmt: skip
TMP_MARKS = (".onegpu-tmp-", ".onegpu-old-", ".onegpu-renames", ".tmp-")


def onegpu(*args: str, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "onegpu", *args], capture_output=True,
                          text=True, **kw)  # fmt: skip


def train(out: Path, *args: str) -> subprocess.CompletedProcess:
    return onegpu("train", *TINY, "--out", str(out), *args)


def whole(path: Path) -> bool:
    """The file parses to its end."""
    data = path.read_bytes()
    if path.suffix == ".json":
        json.loads(data)
    elif path.suffix == ".toml":
        tomllib.loads(data.decode())
    elif path.suffix == ".png":
        return data.startswith(b"\x89PNG") and data.rstrip(b"\x00").endswith(b"IEND\xaeB`\x82")
    elif path.suffix == ".safetensors":
        from safetensors.torch import load_file

        load_file(path)
    return True


def leftovers(folder: Path) -> list[str]:
    return [p.name for p in folder.parent.rglob("*") if p.name.startswith(TMP_MARKS)]


def kill_loop(cmd: list[str], n: int, check: Callable[[], bool],
              after_kill: Callable[[], None], rng: random.Random, where: Path) -> dict:  # fmt: skip
    """Kill `cmd` n times at a random moment; after each, `after_kill` then `check`. The
    moments are uniform over the second half of an uninterrupted run's time (where the writes
    are)."""
    for _ in range(2):  # the second run's time: caches (CPU peaks, compiled code) warm
        t0 = time.perf_counter()
        subprocess.run([sys.executable, "-m", "onegpu", *cmd], capture_output=True, check=True)
        took = time.perf_counter() - t0
    seconds = (0.5 * took, 1.02 * took)
    kills = finished = left_temporaries = 0
    for _ in range(n):
        proc = subprocess.Popen([sys.executable, "-m", "onegpu", *cmd],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
        time.sleep(rng.uniform(*seconds))
        if proc.poll() is None:
            proc.send_signal(signal.SIGKILL)
            kills += 1
        else:
            finished += 1
        proc.wait()
        left_temporaries += bool(leftovers(where))  # the kill landed during a write
        after_kill()
        if not check():
            raise SystemExit(f"{cmd[0]}: a kill left a damaged result")
    return {"kills": kills, "finished_before_the_kill": finished, "uninterrupted_s": round(took, 1),
            "left_temporaries_cleaned_by_the_next_writer": left_temporaries}  # fmt: skip


def scenario_export(work: Path, n: int, rng: random.Random) -> dict:
    from onegpu.runs.atomic import recover

    runs = [work / "run-a", work / "run-b"]
    for run, layers in zip(runs, ("2", "3"), strict=True):
        train(run, "--train.max_steps", "2", "--model.n_layer", layers).check_returncode()
    out = work / "export"
    onegpu("export", str(runs[0]), "--out", str(out)).check_returncode()

    def check() -> bool:
        if not out.exists():
            return False
        layers = json.loads((out / "config.json").read_text())["n_layer"]
        from safetensors.torch import load_file

        blocks = {k.split(".")[2] for k in load_file(out / "model.safetensors") if ".h." in k}
        return len(blocks) == layers and not leftovers(out)

    return kill_loop(["export", str(runs[1]), "--out", str(out), "--overwrite"], n,
                     check, lambda: recover(out), rng, out)  # fmt: skip


def scenario_files(cmd: list[str], folder: Path, files: list[str], n: int, rng) -> dict:
    from onegpu.runs.atomic import finish_together

    def check() -> bool:
        present = [f for f in files if (folder / f).exists()]
        return all(whole(folder / f) for f in present) and not leftovers(folder / "x")

    def after() -> None:
        if folder.exists():
            finish_together(folder)
            for p in folder.glob(".onegpu-tmp-*"):  # a killed writer's, as the next one does
                p.unlink()

    return kill_loop(cmd, n, check, after, rng, folder / "x")


def scenario_concurrent(work: Path, n: int) -> dict:
    ok, after, other = 0, 0, []
    for i in range(n):
        out = work / f"together-{i}"
        cmd = [sys.executable, "-m", "onegpu", "train", *TINY, "--train.max_steps", "3",
               "--out", str(out)]  # fmt: skip
        procs = [subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                  text=True) for _ in range(2)]  # fmt: skip
        results = sorted((p.wait(), p.stderr.read()) for p in procs)
        codes = [c for c, _ in results]
        refused = results[1][1]
        if codes == [0, 2] and "Traceback" not in refused and "PID" in refused:
            ok += 1
        elif codes == [0, 2] and "Traceback" not in refused and "is not empty" in refused:
            after += 1  # started once the first had finished: refused by the folder's run
        else:
            other.append({"exit_codes": codes, "stderr": [e[-600:] for _, e in results]})
    return {"pairs": n, "one_trained_one_refused_naming_the_pid": ok,
            "refused_as_not_empty_after_the_first_finished": after, "otherwise": other}  # fmt: skip


def scenario_disk_full(work: Path) -> dict:
    mnt = work / "small-disk"
    mnt.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=3m", "tmpfs", str(mnt)],
                             capture_output=True, text=True)  # fmt: skip
    if mounted.returncode != 0:
        return {"skipped": f"cannot mount a tmpfs here: {mounted.stderr.strip()}"}
    try:
        args = ["--train.max_steps", "40", "--checkpoint.every", "1", "--checkpoint.keep_last",
                "100", "--train.log_every", "5", "--train.eval_every", "20"]  # fmt: skip
        straight = train(work / "straight", *args)
        full = train(mnt / "run", *args)
        lines = full.stderr.strip().splitlines()
        one_line = full.returncode == 1 and "Traceback" not in full.stderr and lines and \
            "--train.resume auto" in lines[-1]  # fmt: skip
        subprocess.run(["mount", "-o", "remount,size=64m", str(mnt)], check=True)
        resumed = train(mnt / "run", *args, "--train.resume", "auto")

        def losses(run: Path) -> list:
            rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
            return [(r["step"], r.get("loss"), r.get("val_loss")) for r in rows]

        same = resumed.returncode == 0 and losses(work / "straight") == losses(mnt / "run")
        return {"exit_code_when_full": full.returncode, "one_line": bool(one_line),
                "last_line": lines[-1] if lines else "", "resumed_equals_uninterrupted": same,
                "straight_ok": straight.returncode == 0}  # fmt: skip
    finally:
        subprocess.run(["umount", str(mnt)], capture_output=True)


def scenario_data_changed(work: Path) -> dict:
    source = work / "corpus.txt"
    source.write_text("".join(f"line {i}: the quick brown fox\n" for i in range(3000)))
    out = work / "data-run"
    args = ["--data.source", str(source), "--checkpoint.every", "2"]
    first = train(out, *args, "--train.max_steps", "4")
    with source.open("a") as f:
        f.write("appended after the run stopped\n" * 50)
    refused = train(out, *args, "--train.max_steps", "6", "--train.resume", "auto")
    meant = train(out, *args, "--train.max_steps", "6", "--train.resume", "auto",
                  "--train.resume_new_data", "true")  # fmt: skip
    return {"first_ok": first.returncode == 0, "refused_exit": refused.returncode,
            "refusal_names_data_source": "data.source" in refused.stderr,
            "override_exit": meant.returncode}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--kills", type=int, default=10)
    ap.add_argument("--only", default="export,plot,bench,tune,concurrent,disk-full,data-changed")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json")
    a = ap.parse_args()
    rng, only, report = random.Random(a.seed), a.only.split(","), {}
    env_cache = tempfile.mkdtemp(prefix="onegpu-cache-")
    os.environ["ONEGPU_CACHE"] = env_cache  # measured figures of this run only
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        t0 = time.time()
        if "export" in only:
            report["export"] = scenario_export(work, a.kills, rng)
        if "plot" in only:
            run = work / "plotted"
            train(run, "--train.max_steps", "20", "--train.log_every", "1").check_returncode()
            out = work / "plots"
            out.mkdir()
            report["plot"] = scenario_files(["plot", str(run), "--out", str(out / "loss.png")],
                                            out, ["loss.png"], a.kills, rng)  # fmt: skip
        if "bench" in only:
            grid = work / "grid.toml"
            grid.write_text('[[row]]\nname = "fp32"\n[row.overrides]\n"train.precision" = "fp32"\n')
            out = work / "bench"
            report["bench"] = scenario_files(
                ["bench", "--grid-file", str(grid), "--steps", "5", "--repeats", "1",
                          "--preset", "tiny", "--out", str(out)],
                out, ["bench.json", "bench.md", "bench.png"], a.kills, rng)  # fmt: skip
        if "tune" in only:
            out = work / "tune"
            report["tune"] = scenario_files(
                ["tune", "--preset", "small", "--gpu", "RTX4090", "--out", str(out)],
                out, ["tune.json", "tune.md", "best.toml"], a.kills, rng)  # fmt: skip
        if "concurrent" in only:
            report["concurrent"] = scenario_concurrent(work, max(3, a.kills // 2))
        if "disk-full" in only:
            report["disk_full"] = scenario_disk_full(work)
        if "data-changed" in only:
            report["data_changed"] = scenario_data_changed(work)
        report["seconds"] = round(time.time() - t0)
    print(json.dumps(report, indent=1))
    if a.json:
        Path(a.json).write_text(json.dumps(report, indent=1) + "\n")
    bad = []
    if report.get("concurrent", {}).get("otherwise"):
        bad.append("concurrent")
    d = report.get("disk_full", {})
    if "skipped" not in d and d and not (d["one_line"] and d["resumed_equals_uninterrupted"]):
        bad.append("disk-full")
    c = report.get("data_changed")
    if c and not (c["refused_exit"] == 2 and c["refusal_names_data_source"] and c["override_exit"] == 0):  # fmt: skip
        bad.append("data-changed")
    if bad:
        raise SystemExit(f"failed: {', '.join(bad)}")


if __name__ == "__main__":
    main()
