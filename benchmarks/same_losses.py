"""Do two source trees train to bit-identical losses? The check a behaviour-preserving change
(a refactor) must pass, over the technique mixes that exercise most of the build, on both
backends.

Each mix runs `onegpu train --preset tiny ...` once per tree, in a fresh process (PYTHONPATH set
to the tree's src/), on CPU; every logged loss, val_loss and grad_norm of metrics.jsonl must be
equal to the last bit. Prints one row per mix; exits 1 if any differs.

Usage:
  git worktree add /tmp/before HEAD~1
  python benchmarks/same_losses.py --before /tmp/before --after . [--json out.json]
      [--extra '--model.attention sdpa'] [--only fp32,sgd+block+clip]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

MIXES: dict[str, list[str]] = {
    "fp32": ["--train.precision", "fp32"],
    "bf16+dropout": ["--train.precision", "bf16", "--model.dropout", "0.1"],
    "fp16+selective": ["--train.precision", "fp16", "--memory.checkpointing", "selective"],
    "bf16-pure+chunked+accum": ["--train.precision", "bf16-pure", "--memory.loss_chunk", "64",
                                "--train.micro_batch_size", "2"],
    "randomized+gelu2+offload": ["--memory.randomized_linear", "0.5", "--memory.gelu_bits", "2",
                                 "--memory.offload_activations", "true"],
    "in_backward+every2": ["--optim.in_backward", "true", "--memory.checkpointing", "every:2",
                           "--train.micro_batch_size", "8", "--optim.grad_clip", "0"],
    "adafactor+attn+mlp": ["--optim.name", "adafactor", "--memory.checkpointing", "attn+mlp"],
    "adamw8bit+plain": ["--optim.name", "adamw8bit", "--model.attention", "plain"],
    "sgd+block+clip": ["--optim.name", "sgd", "--memory.checkpointing", "block",
                       "--optim.grad_clip", "0.5"],
    "hf-llama": ["--model.hf", "{tiny_llama}", "--model.seq_len", "64"],
}  # fmt: skip
JAX = ["--train.backend", "jax"]
MIXES_JAX: dict[str, list[str]] = {
    "jax fp32": [*JAX, "--train.precision", "fp32"],
    "jax bf16+dropout": [*JAX, "--train.precision", "bf16", "--model.dropout", "0.1"],
    "jax bf16-pure+chunked+accum": [*JAX, "--train.precision", "bf16-pure",
                                    "--memory.loss_chunk", "64", "--train.micro_batch_size", "2"],
    "jax scan+selective": [*JAX, "--model.scan_layers", "true",
                           "--memory.checkpointing", "selective"],
    "jax adafactor+block": [*JAX, "--optim.name", "adafactor", "--memory.checkpointing", "block"],
}  # fmt: skip
KEYS = ("loss", "val_loss", "grad_norm")


def tiny_llama(folder: Path) -> str:
    """A 2-layer Llama config.json (random weights): the Hugging Face path of the build."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
        "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "vocab_size": 256, "max_position_embeddings": 128,
        "tie_word_embeddings": False,
    }))  # fmt: skip
    return str(folder)


def run(tree: str, args: list[str], workdir: Path) -> list[dict]:
    out = workdir / f"run-{time.monotonic_ns()}"
    env = {**os.environ, "PYTHONPATH": str(Path(tree).resolve() / "src"),
           "ONEGPU_CACHE": str(workdir / "cache")}  # fmt: skip
    cmd = [sys.executable, "-m", "onegpu", "train", "--preset", "tiny", *args, "--out", str(out),
           "--out.progress", "false", "--train.device", "cpu",
           "--train.skip_memory_check", "true"]  # the check plans; it changes no loss  # fmt: skip
    subprocess.run(cmd, env=env, check=True, capture_output=True, cwd=workdir)
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [{k: r[k] for k in KEYS if k in r} | {"step": r["step"]} for r in rows]


def _unless_set(extra: str, args: list[str]) -> list[str]:
    """`extra`'s flag-value pairs that the mix does not set itself."""
    words = extra.split()
    pairs = zip(words[::2], words[1::2], strict=True)
    return [w for flag, value in pairs if flag not in args for w in (flag, value)]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--before", required=True, help="source tree (holding src/onegpu) before")
    ap.add_argument("--after", required=True, help="source tree after")
    ap.add_argument("--json", help="write the logged values of both trees here")
    ap.add_argument("--backends", default="torch,jax", help="whose mixes run (default: both)")
    ap.add_argument(
        "--extra",
        default="",
        help="flags added to every mix, e.g. '--model.attention sdpa': pins a choice whose "
        "math a change alters by design, so that the rest can be checked bit for bit",
    )
    ap.add_argument("--only", help="these mixes (comma-separated names), e.g. those a flag of "
                    "--extra allows (blocked attention refuses dropout)")  # fmt: skip
    a = ap.parse_args()
    mixes = {**(MIXES if "torch" in a.backends else {}),
             **(MIXES_JAX if "jax" in a.backends else {})}  # fmt: skip
    if a.only:
        unknown = set(a.only.split(",")) - set(mixes)
        if unknown:
            sys.exit(f"--only: unknown mixes {sorted(unknown)}; choose from {', '.join(mixes)}")
        mixes = {n: mixes[n] for n in a.only.split(",")}
    report, bad = {}, 0
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        llama = tiny_llama(work / "tiny-llama")
        for name, args in mixes.items():
            args = [x.replace("{tiny_llama}", llama) for x in args] + _unless_set(a.extra, args)
            before, after = run(a.before, args, work), run(a.after, args, work)
            same = before == after
            bad += not same
            last = after[-1]
            print(f"{name:<26} {'identical' if same else 'DIFFERENT'}  ({len(after)} rows, "
                  f"final loss {last.get('loss', last.get('val_loss'))})", flush=True)  # fmt: skip
            report[name] = {"args": args, "identical": same, "before": before, "after": after}
    if a.json:
        Path(a.json).write_text(json.dumps(report, indent=1))
    print(f"{len(mixes) - bad} of {len(mixes)} mixes bit-identical")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
