"""Hugging Face architectures through onegpu on this machine: for each, a small model folder
(random weights saved as safetensors, the way a user's checkpoint arrives) is trained with the
defaults and with the configuration `onegpu tune` picks under half of the defaults' planned
peak; then exported and loaded back by transformers (parity of logits).

    python benchmarks/hf_models.py [--archs llama,qwen2,mistral,phi,gpt2] [--steps 30]
        [--time-budget 60] [--out benchmarks/results/hf-models]

Every run is a fresh `onegpu` process; rows report summary.json's median tokens/s and peak
memory (on a CPU the process's peak RSS). Writes OUT/hf-models.md and OUT/hf-models.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import transformers

SIZE = dict(hidden=256, layers=4, heads=4, kv_heads=2, inner=768, vocab=8192, positions=1024)
DATA = [
    "--data.tokenizer", "bpe", "--data.tokenizer_vocab", str(SIZE["vocab"]),
    "--model.seq_len", "256", "--train.batch_size", "16", "--train.micro_batch_size", "16",
]  # fmt: skip


def hf_config(arch: str):
    s = SIZE
    if arch == "gpt2":
        return transformers.GPT2Config(
            n_embd=s["hidden"], n_layer=s["layers"], n_head=s["heads"], n_inner=4 * s["hidden"],
            vocab_size=s["vocab"], n_positions=s["positions"],
            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
        )  # fmt: skip
    common = dict(
        hidden_size=s["hidden"], intermediate_size=s["inner"], num_hidden_layers=s["layers"],
        num_attention_heads=s["heads"], vocab_size=s["vocab"], max_position_embeddings=s["positions"],
    )  # fmt: skip
    if arch == "phi":  # GELU MLP of 4 x hidden, as Phi's own configs
        return transformers.PhiConfig(**{**common, "intermediate_size": 4 * s["hidden"]})
    cls = {"llama": transformers.LlamaConfig, "qwen2": transformers.Qwen2Config,
           "mistral": transformers.MistralConfig}[arch]  # fmt: skip
    return cls(**common, num_key_value_heads=s["kv_heads"])


def onegpu(*args: str) -> str:
    proc = subprocess.run(
        [sys.executable, "-m", "onegpu", *args], capture_output=True, text=True, env=os.environ
    )
    if proc.returncode != 0:
        raise RuntimeError(f"onegpu {' '.join(args)} failed:\n{proc.stderr[-3000:]}")
    return proc.stdout


def train(folder: Path, out: Path, steps: int, extra: list[str]) -> dict:
    onegpu(
        "train", "--model.hf", str(folder), *DATA, "--train.max_steps", str(steps),
        "--train.log_every", "5", "--train.eval_every", "0", "--out.progress", "false",
        "--out", str(out), *extra,
    )  # fmt: skip
    return json.loads((out / "summary.json").read_text())


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--archs", default="llama,qwen2,mistral,phi,gpt2")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--time-budget", type=float, default=60)
    p.add_argument("--out", default="benchmarks/results/hf-models")
    args = p.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        for arch in args.archs.split(","):
            folder = work / arch
            torch.manual_seed(0)
            model = transformers.AutoModelForCausalLM.from_config(hf_config(arch))
            model.save_pretrained(folder)
            params = sum(p.numel() for p in model.parameters())
            plain = train(folder, work / f"{arch}-plain", args.steps, [])
            plan = json.loads(onegpu("plan", "--model.hf", str(folder), *DATA, "--json"))
            budget = int(plan["memory"]["peak"] * 0.5)
            t0 = time.perf_counter()
            onegpu(
                "tune", "--model.hf", str(folder), *DATA, "--memory", str(budget),
                "--time-budget", str(args.time_budget), "--out", str(work / f"{arch}-tune"),
            )  # fmt: skip
            tune_s = time.perf_counter() - t0
            best_toml = work / f"{arch}-tune" / "best.toml"
            best_change = json.loads((work / f"{arch}-tune" / "tune.json").read_text())["best"]
            best = train(folder, work / f"{arch}-best", args.steps, ["--config", str(best_toml)])
            export = json.loads(
                onegpu("export", str(work / f"{arch}-best"), "--out", str(work / f"{arch}-hf"))
            )
            rows.append(
                {
                    "arch": arch,
                    "class": type(model).__name__,
                    "params": params,
                    "plain": {k: plain[k] for k in ("tokens_per_s", "peak_mem_bytes", "loss")},
                    "planned_plain_peak_bytes": plan["memory"]["peak"],
                    "tune_budget_bytes": budget,
                    "tune_seconds": tune_s,
                    "best_change": best_change["change"],
                    "best": {k: best[k] for k in ("tokens_per_s", "peak_mem_bytes", "loss")},
                    "best_planned_peak_bytes": best_change["planned_peak_bytes"],
                    "best_measured_tensor_peak_bytes": best_change["peak_mem_bytes"],
                    "export_parity_max_abs_logit_diff": export["parity_max_abs_logit_diff"],
                    "export_logit_scale": export["parity_logit_scale"],
                }
            )
            print(json.dumps(rows[-1]), flush=True)
    (out / "hf-models.json").write_text(json.dumps(rows, indent=1) + "\n")
    (out / "hf-models.md").write_text(markdown(rows, args))


def markdown(rows: list[dict], args) -> str:
    mib = 2**20
    lines = [
        "# Hugging Face architectures through onegpu",
        "",
        f"Each: {SIZE['layers']} layers x d{SIZE['hidden']}, {SIZE['heads']} heads "
        f"(Llama/Qwen2/Mistral: {SIZE['kv_heads']} key/value heads), vocabulary {SIZE['vocab']} "
        f"(a byte-level BPE trained on the stdlib corpus), seq 256, batch 16; {args.steps} steps, "
        "median tokens/s of summary.json; peak memory = the process's peak RSS on this CPU. "
        "'tuned' = `onegpu tune --memory B` with B = half of the defaults' planned peak, then "
        f"`onegpu train --config best.toml` (time budget {args.time_budget:.0f} s of trials).  ",
        f"Machine: {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, torch "
        f"{torch.__version__}, transformers {transformers.__version__}; "
        f"{time.strftime('%Y-%m-%d %H:%M')}.  ",
        f"Command: `python benchmarks/hf_models.py --steps {args.steps} --time-budget "
        f"{args.time_budget:.0f}`",
        "",
        "| architecture | params | defaults tokens/s | defaults peak RSS | tuned configuration "
        "| tuned tokens/s | tuned peak RSS | tuned planned / measured tensor peak | budget "
        "| export parity (max abs logit diff) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        change = ", ".join(f"{k.split('.')[-1]}={v}" for k, v in r["best_change"].items())
        lines.append(
            f"| {r['class']} | {r['params'] / 1e6:.1f}M | {r['plain']['tokens_per_s']:,.0f} "
            f"| {r['plain']['peak_mem_bytes'] / mib:,.0f} MiB | {change} "
            f"| {r['best']['tokens_per_s']:,.0f} | {r['best']['peak_mem_bytes'] / mib:,.0f} MiB "
            f"| {r['best_planned_peak_bytes'] / mib:,.0f} / "
            f"{r['best_measured_tensor_peak_bytes'] / mib:,.0f} MiB "
            f"| {r['tune_budget_bytes'] / mib:,.0f} MiB "
            f"| {r['export_parity_max_abs_logit_diff']:.1e} (logits up to "
            f"{r['export_logit_scale']:.1f}) |"
        )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
