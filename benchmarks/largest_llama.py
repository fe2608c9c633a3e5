"""Which Llama-shaped models train in full (no adapters) on RTX4090, A100-40 and H100-80: HF
Trainer's defaults against onegpu on the device and with the optimizer in host memory.

Planned, not measured (`onegpu plan` on fake tensors; no GPU needed): Llama-3.2-1B, -3B,
Llama-3-8B and Llama-2-13B shapes (their public config.json values, random weights), sequence
2048, batch 8 in micro-batches of 1. Three configurations:

- Trainer's defaults: bf16 autocast over fp32 weights, AdamW, no checkpointing, plain loss;
- onegpu on the device: bf16-pure, 8-bit AdamW, block checkpointing, chunked loss;
- onegpu + host: the same with memory.offload_optimizer (states and weight copies on the host,
  stepped on the host CPU at this machine's measured rate for 8-bit AdamW);
- onegpu + states on the host: the same with memory.offload_states, stepped on the GPU in
  backward (batch 8 as one micro-batch: nothing to accumulate).

The device peak does not depend on which bf16 GPU it is planned for; the predicted speed does
(its bf16 peak at 40%, its PCIe link at 80%, and this machine's measured CPU optimizer step).

Usage: python benchmarks/largest_llama.py [--out benchmarks/results/largest-llama.md]
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

from onegpu.config import load_config
from onegpu.offload.pricing import BACKWARD_SHARE, LINK_EFFICIENCY
from onegpu.perf.devices import GPUS, GiB
from onegpu.plan.report import plan_report
from onegpu.plan.targets import CUDA_OVERHEAD_BYTES, EFFICIENCY

BASE = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0,
    "max_position_embeddings": 8192,
    "hidden_act": "silu",
}
SHAPES = {
    "Llama-3.2-1B": dict(hidden_size=2048, num_hidden_layers=16, num_attention_heads=32,
                         num_key_value_heads=8, intermediate_size=8192, vocab_size=128256,
                         tie_word_embeddings=True),
    "Llama-3.2-3B": dict(hidden_size=3072, num_hidden_layers=28, num_attention_heads=24,
                         num_key_value_heads=8, intermediate_size=8192, vocab_size=128256,
                         tie_word_embeddings=True),
    "Llama-3-8B": "llama-3-8b",  # packaged with onegpu
    "Llama-2-13B": dict(hidden_size=5120, num_hidden_layers=40, num_attention_heads=40,
                        num_key_value_heads=40, intermediate_size=13824, vocab_size=32000,
                        tie_word_embeddings=False, rope_theta=10000.0,
                        max_position_embeddings=4096),
}  # fmt: skip
RUN = {"train.device": "cpu", "model.seq_len": "2048", "train.batch_size": "8",
       "train.micro_batch_size": "1"}  # fmt: skip
CONFIGS = {
    "HF Trainer defaults": {"train.precision": "bf16", "optim.name": "adamw",
                            "memory.checkpointing": "none", "memory.loss_chunk": "0"},
    "onegpu, on the device": {"train.precision": "bf16-pure", "optim.name": "adamw8bit",
                              "memory.checkpointing": "block", "memory.loss_chunk": "1024"},
    "onegpu, optimizer in host memory": {"train.precision": "bf16-pure", "optim.name": "adamw8bit",
                                         "memory.checkpointing": "block",
                                         "memory.loss_chunk": "1024",
                                         "memory.offload_optimizer": "true"},
    # batch 8 as one micro-batch of 8: the optimizer in backward accumulates nothing
    "onegpu, states in host memory, stepped on the GPU in backward": {
        "train.precision": "bf16-pure", "optim.name": "adamw8bit",
        "memory.checkpointing": "block", "memory.loss_chunk": "1024",
        "memory.offload_states": "true", "optim.in_backward": "true", "optim.grad_clip": "0",
        "train.micro_batch_size": "8"},
}  # fmt: skip
TARGETS = ("RTX4090", "A100-40", "H100-80")


def tokens_per_s(r: dict, gpu: str) -> float:
    """The plan's predicted speed re-priced for `gpu` (same model of the step as onegpu plan)."""
    spec, tokens = GPUS[gpu], 8 * 2048
    recompute = r.get("recompute_factor", 1.0)  # block checkpointing runs forward twice
    step = r["flops_per_token"] * recompute * tokens / (spec.peak["bf16"] * EFFICIENCY)
    if o := r.get("offload"):  # as offload/pricing.py prices it, on this GPU's link
        rate = spec.host_link * LINK_EFFICIENCY
        states = o.get("states_link_s", 0.0) * o.get("link_rate", rate)  # bytes (in backward)
        beside = max(step, (o["link_bytes"] - states) / rate)
        step = beside + max(0.0, states / rate - step * BACKWARD_SHARE) + o["host_step_s"]
    return tokens / step


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--out", default="benchmarks/results/largest-llama-new.md")
    a = ap.parse_args()
    plans: dict[str, dict[str, dict]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for shape, spec in SHAPES.items():
            folder = spec
            if isinstance(spec, dict):
                folder = str(Path(tmp) / shape)
                Path(folder).mkdir()
                (Path(folder) / "config.json").write_text(json.dumps({**BASE, **spec}))
            for name, over in CONFIGS.items():
                cfg = load_config(overrides={**RUN, **over, "model.hf": folder})
                r = plan_report(cfg, "H100-80", None, host_memory=2**40)
                plans.setdefault(shape, {})[name] = r
                print(f"{shape} / {name}: {r['memory']['peak'] / GiB:,.1f} GiB device, "
                      f"{r['memory'].get('host', 0) / GiB:,.1f} GiB host", flush=True)  # fmt: skip
    lines = ["# The largest Llama-shaped model one GPU trains in full (planned)", "",
             "`python benchmarks/largest_llama.py`: sequence 2048, batch 8 x 1, every parameter "
             "trained; a prediction (fake tensors), 0.5 GiB kept for the CUDA context.", "",
             "| model | configuration | device | host | " + " | ".join(TARGETS) + " |",
             "|---|---|---|---|" + "---|" * len(TARGETS)]  # fmt: skip
    largest: dict[tuple[str, str], tuple[str, float]] = {}
    for shape, by_cfg in plans.items():
        for name, r in by_cfg.items():
            mem = r["memory"]
            cells = []
            for gpu in TARGETS:
                fits = mem["peak"] + CUDA_OVERHEAD_BYTES <= GPUS[gpu].memory_bytes
                speed = tokens_per_s(r, gpu)
                cells.append(f"{speed:,.0f} tok/s" if fits else "does not fit")
                if fits:
                    largest[(gpu, name)] = (shape, speed)
            lines.append(f"| {shape} | {name} | {mem['peak'] / GiB:,.1f} GiB | "
                         f"{mem.get('host', 0) / GiB:,.1f} GiB | " + " | ".join(cells) + " |")  # fmt: skip
    lines += ["", "Largest that fits, and its predicted speed:", "",
              "| GPU | " + " | ".join(CONFIGS) + " |", "|---|" + "---|" * len(CONFIGS)]  # fmt: skip
    for gpu in TARGETS:
        cells = [f"{largest[(gpu, n)][0]} ({largest[(gpu, n)][1]:,.0f} tok/s)"
                 if (gpu, n) in largest else "none of these" for n in CONFIGS]  # fmt: skip
        lines.append(f"| {gpu} | " + " | ".join(cells) + " |")
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
