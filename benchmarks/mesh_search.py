"""Which mesh for a Llama-3-8B-sized model on N GPUs: `onegpu tune --gpu NAME --world-size N`.

For each (GPU, count, interconnect) the search crosses every layout of the processes (DDP, FSDP,
HSDP, TP, PP and their products) with checkpointing and micro-batch, plans them fastest
predicted step first and stops at the first that fits (plan/mesh_search.py). The table gives,
per case, the configuration as given (FSDP over all GPUs, no checkpointing, micro-batch 1) and
what the search returns: largest rank's planned peak, predicted tokens/s, and the search's cost.

    python benchmarks/mesh_search.py

Writes benchmarks/results/mesh-search-<date>.md (a new file each run). Predictions, not
measurements: no GPU is needed or used.
"""

from __future__ import annotations

import datetime
import os
import time

from parallel_layouts import LLAMA_SIZED as PLANNED_MODEL
from records import write_result

from onegpu.config import load_config
from onegpu.perf.devices import GPUS
from onegpu.plan.mesh import predicted_step
from onegpu.plan.mesh_search import largest_rank, model_facts, search_meshes
from onegpu.plan.targets import CUDA_OVERHEAD_BYTES, gpu_caps

LLAMA_SIZED = {**PLANNED_MODEL, "memory.checkpointing": "none", "dist.strategy": "fsdp"}
CASES = [
    ("H100-80", 8, "nvlink"),
    ("A100-40", 8, "nvlink3"),
    ("RTX4090", 8, "pcie4"),
    ("RTX4090", 4, "pcie4"),
    ("L4", 8, "pcie4"),
]
GIB = 2**30


def as_given(cfg, gpu: str, world: int, interconnect: str) -> str:
    caps = gpu_caps(gpu)
    peak, _ = largest_rank(cfg, "cuda", caps, world)
    facts = model_facts(cfg, {"none"}, "cuda", caps)
    step = predicted_step(cfg, facts.plan, gpu, world, interconnect)
    fits = peak + CUDA_OVERHEAD_BYTES <= GPUS[gpu].memory_bytes
    return f"{peak / GIB:.1f} GiB{'' if fits else ' (does not fit)'}, {step['predicted_tokens_per_s']:,.0f} tokens/s"


def main() -> None:
    cfg = load_config("tiny", overrides={k: str(v) for k, v in LLAMA_SIZED.items()})
    lines = [
        f"# Mesh search: a Llama-3-8B-sized GPT on N GPUs ({datetime.date.today()})",
        "",
        "Predicted, not measured (plan/mesh_search.py; compute at 40% of the datasheet peak, links "
        "at 70% of their datasheet rate). The model: d_model 4096, 32 blocks, 32 heads, vocabulary "
        "128,256, untied (7.5B parameters), bf16 autocast, AdamW, batch 32 x 2048.",
        f"Command: `python benchmarks/mesh_search.py`; each row is `onegpu tune --gpu GPU "
        f"--world-size N --interconnect LINK` on this config. Machine: {os.cpu_count()}-core CPU "
        "(the planner's; no GPU used).",
        "",
        "| GPUs | link | as given: FSDP over all, no checkpointing, micro 1 | the search's fastest "
        "that fits | largest rank | predicted tokens/s | candidates / skipped / planned | search s |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for gpu, world, interconnect in CASES:
        budget = GPUS[gpu].memory_bytes - CUDA_OVERHEAD_BYTES
        t0 = time.perf_counter()
        r = search_meshes(cfg, gpu, gpu_caps(gpu), world, interconnect, budget, 2**42, log=print)
        seconds = time.perf_counter() - t0
        best = r["best"]
        found = (
            (best["label"], f"{best['peak_bytes'] / GIB:.1f} GiB", f"{best['tokens_per_s']:,.0f}")
            if best
            else ("nothing fits", "-", "-")
        )
        lines.append(
            f"| {world} x {gpu} | {interconnect} | {as_given(cfg, gpu, world, interconnect)} | "
            f"{found[0]} | {found[1]} | {found[2]} | {r['candidates']} / "
            f"{r['skipped_by_arithmetic']} / {r['planned']} | {seconds:.0f} |"
        )
        print(lines[-1], flush=True)
    write_result("mesh-search", lines)


if __name__ == "__main__":
    main()
