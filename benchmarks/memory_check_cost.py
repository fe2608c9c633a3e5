"""What the start-up memory check of `onegpu train` costs: the plan of each preset's default run,
first on a fresh cache (a fresh process each), then from the cache (`start-plans.json`).

Usage: python benchmarks/memory_check_cost.py [--presets tiny,small,gpt2,gpt2-xl]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
from pathlib import Path

WORKER = """
import json, sys, time
t0 = time.perf_counter()
from onegpu.config import load_config
from onegpu.plan.startup import planned_need
cfg = load_config(sys.argv[1], overrides={"train.device": "cpu"})
t1 = time.perf_counter()
need = planned_need(cfg, "cpu")
print(json.dumps({"check_s": time.perf_counter() - t1, "peak": need["peak"]}))
"""


def once(preset: str, cache: str) -> dict:
    env = {**os.environ, "ONEGPU_CACHE": cache}
    out = subprocess.run([sys.executable, "-c", WORKER, preset], env=env, capture_output=True,
                         text=True, check=True)  # fmt: skip
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--presets", default="tiny,small,gpt2,gpt2-xl")
    a = ap.parse_args()
    bf16 = "avx512_bf16" in Path("/proc/cpuinfo").read_text()
    print(f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
          f"{'AVX512-BF16' if bf16 else 'AVX2 only'}")  # fmt: skip
    print("| preset | planned peak | first check (fresh cache) | cached check |")
    print("|---|---|---|---|")
    for preset in a.presets.split(","):
        with tempfile.TemporaryDirectory() as cache:
            first, again = once(preset, cache), once(preset, cache)
        print(f"| {preset} | {first['peak'] / 2**20:,.0f} MiB | {first['check_s']:.1f} s | "
              f"{again['check_s'] * 1e3:.0f} ms |", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
