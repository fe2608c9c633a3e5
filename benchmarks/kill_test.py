"""Kill -9 a training run at random moments, resume it each time, and check that nothing is lost.

One run (tiny preset, a checkpoint every step, so that many kills land during a checkpoint
write) is started with `--train.resume auto`, killed with SIGKILL at a random moment, and
started again, until it finishes or the kill budget is spent. After every kill: every complete
checkpoint must load (`weights_only=True`), and leftovers may only be `.tmp-*` files. At the
end, the final weights and the logged losses must equal those of the same run uninterrupted.

Usage: python benchmarks/kill_test.py [--kills 50] [--steps 6000] [--json results.json]
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
from pathlib import Path

import torch
from safetensors.torch import load_file

ARGS = ["--preset", "tiny", "--train.device", "cpu", "--out.progress", "false",
        "--train.eval_every", "500", "--train.log_every", "5", "--checkpoint.every", "1",
        "--checkpoint.keep_last", "2", "--train.measure_memory", "false"]  # fmt: skip


def command(out: Path, steps: int) -> list[str]:
    return [sys.executable, "-m", "onegpu", "train", *ARGS, "--train.max_steps", str(steps),
            "--out", str(out), "--train.resume", "auto"]  # fmt: skip


def check_checkpoints(folder: Path) -> tuple[int, int]:
    """(complete checkpoints that load, leftovers): raises if a complete one does not load."""
    complete = leftovers = 0
    for p in folder.glob("*") if folder.is_dir() else []:
        if p.name.startswith(".tmp-"):
            leftovers += 1
            continue
        state = torch.load(p, map_location="cpu", weights_only=True)
        assert state["format"] == 1 and "model" in state, p
        complete += 1
    return complete, leftovers


def losses(out: Path) -> list:
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [(r["step"], r.get("loss"), r.get("val_loss")) for r in rows]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--kills", type=int, default=50)
    ap.add_argument("--steps", type=int, default=6000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json")
    a = ap.parse_args()
    rng = random.Random(a.seed)
    env = {**os.environ, "ONEGPU_ALLOCATOR": "system"}
    with tempfile.TemporaryDirectory() as tmp:
        straight, killed = Path(tmp) / "straight", Path(tmp) / "killed"
        subprocess.run(command(straight, a.steps), env=env, check=True, capture_output=True)
        kills = loaded = leftovers_seen = restarts = 0
        finished = False
        t0 = time.time()
        while not finished:
            proc = subprocess.Popen(command(killed, a.steps), env=env,
                                    stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)  # fmt: skip
            restarts += 1
            if kills < a.kills:
                time.sleep(rng.uniform(2.0, 8.0))  # start-up is ~2-4 s: some kills land there
                if proc.poll() is None:
                    proc.send_signal(signal.SIGKILL)
                    kills += 1
            _, err = proc.communicate()
            finished = proc.returncode == 0
            if proc.returncode not in (0, -signal.SIGKILL):
                raise SystemExit(f"run failed with {proc.returncode}: {err.decode()[-2000:]}")
            complete, leftovers = check_checkpoints(killed / "checkpoints")
            loaded += complete
            leftovers_seen += leftovers > 0
        a_w, b_w = (
            load_file(straight / "model.safetensors"),
            load_file(killed / "model.safetensors"),
        )
        same_weights = a_w.keys() == b_w.keys() and all(torch.equal(a_w[k], b_w[k]) for k in a_w)
        same_losses = losses(straight) == losses(killed)
    report = {
        "kills": kills,
        "restarts": restarts,
        "complete_checkpoints_loaded_after_kills": loaded,
        "kills_that_left_a_partial_save": leftovers_seen,
        "final_weights_equal_uninterrupted": same_weights,
        "logged_losses_equal_uninterrupted": same_losses,
        "steps": a.steps,
        "seconds": round(time.time() - t0),
    }
    print(json.dumps(report, indent=1))
    if a.json:
        Path(a.json).write_text(json.dumps(report, indent=1) + "\n")
    if not (same_weights and same_losses):
        raise SystemExit("the killed run differs from the uninterrupted one")


if __name__ == "__main__":
    main()
