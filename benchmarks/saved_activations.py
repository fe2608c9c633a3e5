"""Saved-activation bytes of one forward per memory technique (exact, via saved_tensors_hooks).

Usage: python benchmarks/saved_activations.py [--preset tiny] [--layers 4] [--batch 4]
Writes a Markdown table to stdout (benchmarks/memory_ablation.py has the seed-ref ablation with
time and peak memory).
"""

from __future__ import annotations

import argparse

import torch

from onegpu.backends.torch.build import build
from onegpu.config import load_config

SETTINGS = [
    {},
    {"memory.checkpointing": "mlp"},
    {"memory.checkpointing": "every:2"},
    {"memory.checkpointing": "selective"},
    {"memory.checkpointing": "attn"},
    {"memory.checkpointing": "attn+mlp"},
    {"memory.checkpointing": "block"},
    {"memory.gelu_bits": "2"},
    {"memory.randomized_linear": "0.25"},
    {
        "memory.gelu_bits": "2",
        "memory.randomized_linear": "0.25",
        "memory.checkpointing": "attn+mlp",
    },
]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--layers", default="4")
    ap.add_argument("--batch", type=int, default=4)
    args = ap.parse_args()
    print("| settings | saved bytes | vs none |\n|---|---|---|")
    base = None
    for extra in SETTINGS:
        over = {
            "train.device": "cpu",
            "train.precision": "fp32",
            "model.n_layer": args.layers,
            "model.dropout": "0.1",
            **extra,
        }
        built = build(
            load_config(args.preset, overrides=over), torch.device("cpu"), with_data=False
        )
        x = torch.randint(0, 256, (args.batch, built.cfg.train_seq_len))
        with built.saved_counter() as c:
            loss = built.loss_fn(built.model, x, x)
        loss.backward()
        base = base or c.bytes
        name = ", ".join(f"{k.split('.')[1]}={v}" for k, v in extra.items()) or "none"
        print(f"| {name} | {c.bytes:,} | {c.bytes / base:.2f} |")


if __name__ == "__main__":
    main()
