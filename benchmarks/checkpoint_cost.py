"""What a training checkpoint costs: its size and the time to write it crash-safely.

Builds a preset (no data: random tokens), runs one step so the optimizer states exist, then
writes the full checkpoint (model, optimizer, scaler, RNG, meter, config) with the same
temporary-file + fsync + rename path as training, `--repeats` times; reports the size and the
median time, and the time to load it back with `weights_only=True`.

Usage: python benchmarks/checkpoint_cost.py [--presets seed-ref,gpt2] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import tempfile
import time
from pathlib import Path

import torch

from onegpu.backends.torch import checkpoint as ckpt
from onegpu.backends.torch.build import build
from onegpu.backends.torch.totals import meter_for
from onegpu.config import load_config
from onegpu.runs import checkpoints


def cost(preset: str, repeats: int) -> dict:
    cfg = load_config(preset, overrides={"train.device": "cpu", "train.batch_size": "1",
                                         "train.micro_batch_size": "1"})  # fmt: skip
    built = build(cfg, with_data=False)
    x = torch.randint(0, cfg.model.vocab_size, (1, cfg.train_seq_len + 1))
    built.step(x[:, :-1], x[:, 1:], x.shape[1] - 1, 0)
    meter = meter_for(built, None)
    common = checkpoints.common_state(
        built.cfg, backend="torch", step=1, meter=meter.state_dict(), data=None
    )
    state = ckpt.state_of(built, common)
    saves, loads = [], []
    with tempfile.TemporaryDirectory(dir=".") as tmp:
        path = Path(tmp) / ckpt.checkpoint_name(1)
        for _ in range(repeats):
            t0 = time.perf_counter()
            ckpt.save_file(path, state)
            saves.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            ckpt.load(path)
            loads.append(time.perf_counter() - t0)
        size = path.stat().st_size
    return {"preset": preset, "params": built.n_params, "precision": built.policy.name,
            "optimizer": cfg.optim.name, "bytes": size, "save_s": statistics.median(saves),
            "load_s": statistics.median(loads), "saves": saves}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--presets", default="seed-ref,gpt2")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json")
    a = ap.parse_args()
    rows = [cost(p, a.repeats) for p in a.presets.split(",")]
    for r in rows:
        print(f"{r['preset']}: {r['params']:,} parameters ({r['precision']}, {r['optimizer']}): "
              f"{r['bytes'] / 2**20:,.0f} MiB, saved in {r['save_s']:.2f} s, "
              f"loaded in {r['load_s']:.2f} s")  # fmt: skip
    if a.json:
        Path(a.json).write_text(json.dumps({"machine": platform.platform(), "rows": rows},
                                           indent=1) + "\n")  # fmt: skip


if __name__ == "__main__":
    main()
