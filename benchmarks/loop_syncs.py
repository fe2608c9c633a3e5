"""Host-device synchronisations of the training loop, counted on a real GPU.

CUDA's sync debug mode (`torch.cuda.set_sync_debug_mode("warn")`) warns at every operation that
makes the host wait for the device (.item(), a device-to-host copy, ...). A run of N steps and a
run of 3N steps, each logging once, must warn equally often: any warning inside a step would
make the longer run warn more. On a CPU the same property is tested by counting scalar reads
(tests/step/test_step.py); this is the check where syncs cost time.

Usage: python benchmarks/loop_syncs.py [--steps 10] [--precisions bf16,fp16,fp32]
"""

from __future__ import annotations

import argparse
import json
import tempfile
import warnings

import torch

from onegpu.config import load_config
from onegpu.train import train


def syncs_of_a_run(precision: str, steps: int, out: str) -> int:
    cfg = load_config(
        "small",
        overrides={
            "train.precision": precision,
            "train.max_steps": str(steps),
            "train.log_every": str(steps),
            "train.eval_every": "0",
            "train.measure_memory": "false",
            "out.progress": "false",
            "out.save_checkpoint": "false",
            "out.dir": out,
        },
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            train(cfg)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return sum("synchroniz" in str(w.message) for w in caught)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--precisions", default="bf16,fp16,fp32")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA GPU (on a CPU: pytest tests/step/test_step.py)")
    rows = []
    for precision in args.precisions.split(","):
        with tempfile.TemporaryDirectory() as tmp:
            short = syncs_of_a_run(precision, args.steps, f"{tmp}/a")
            long = syncs_of_a_run(precision, 3 * args.steps, f"{tmp}/b")
        rows.append({"precision": precision, "steps": [args.steps, 3 * args.steps],
                     "syncs": [short, long], "per_step": (long - short) / (2 * args.steps)})  # fmt: skip
        print(json.dumps(rows[-1]))
    print(json.dumps({"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                      "rows": rows}))  # fmt: skip


if __name__ == "__main__":
    main()
