"""The chunked loss's compiled kernels against ATen's, on the real model's forward + backward,
paired step by step in one process.

    LD_PRELOAD=$(python -c "from onegpu.perf.allocator import find_mimalloc as f; print(f())") \\
        MIMALLOC_PURGE_DELAY=-1 python benchmarks/loss_kernels.py [--models A,B] [--rounds 12]

Each model (benchmarks/vs_peers.py's A and B) is built once by onegpu (its `auto` attention and
loss chunk, bf16 where the CPU has it); then one micro-batch's forward + backward runs with the
loss's ATen kernels and with the compiled ones, alternately, `--rounds` times each. Alternating
in one process cancels what drifts on a shared machine (two fresh processes of one setting
differed by up to 7% here), which is why this, not fresh runs, measures a cut of ~5%. Also
checks that both give the same loss (fp32 rounding apart). The compiled kernels are what
`train.loss_kernel compiled` runs: on a CPU the C++ softmax gradient (loss_kernel_cpu.py).
With `--softmax`, also the softmax-gradient kernel alone at each model's chunk shape: ATen's
passes, inductor's kernel, inductor's written with the padding masked in every pass instead
(what it was first), and the C++ kernel. Writes results/loss-kernels-<date>.{md,json} (never over an earlier file).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from onegpu.backends.torch.build import build
from onegpu.config import load_config
from onegpu.perf.allocator import active_allocator
from onegpu.perf.devices import cpu_identity
from onegpu.techniques import loss_kernel_cpu
from onegpu.techniques.chunked_loss import _softmax_grad, chunked_token_loss_sum
from onegpu.techniques.loss_kernels import compiled_kernels, softmax_grad

sys.path.insert(0, str(Path(__file__).parent))
from vs_peers import MODELS, RESULTS, _new_stem  # noqa: E402


def _model(name: str):
    over = dict(MODELS[name]["over"])
    args = MODELS[name]["args"]
    over |= {a[2:]: b for a, b in zip(args[::2], args[1::2]) if a != "--preset"}
    over |= {"train.compile": "none", "train.loss_kernel": "eager", "out.progress": "false"}
    cfg = load_config(MODELS[name]["preset"], overrides=over)
    return build(cfg, torch.device("cpu"), with_data=False)


def loss_stepper(built, losses: dict) -> tuple[Callable[[Any], float], dict]:
    """A timer of one micro-batch's forward + backward of the model through `losses[key]`
    (one random batch, the same every time), and the dict it leaves each key's loss in."""
    cfg, model = built.cfg, built.model
    g = torch.Generator().manual_seed(0)
    shape = (cfg.train.micro_batch_size, cfg.train_seq_len)
    x = torch.randint(0, cfg.model.vocab_size, shape, generator=g)
    y = torch.randint(0, cfg.model.vocab_size, shape, generator=g)
    values: dict = {}

    def step(key: Any) -> float:
        t0 = time.perf_counter()
        with built.policy.autocast(built.device):
            loss = losses[key](model, x, y)
        loss.backward()
        model.zero_grad(set_to_none=True)
        values[key] = loss.item()
        return time.perf_counter() - t0

    return step, values


def measure(name: str, rounds: int) -> dict:
    built = _model(name)
    cfg = built.cfg
    chunk = cfg.memory.loss_chunk
    if not chunk:
        return {"model": name, "chunk": 0}
    losses = {
        "eager": chunked_token_loss_sum(chunk),
        "compiled": chunked_token_loss_sum(chunk, compiled_kernels()),
    }
    step, values = loss_stepper(built, losses)
    first = {k: step(k) for k in losses}  # the compiled one compiles
    step("eager")
    times: dict[str, list[float]] = {k: [] for k in losses}
    for _ in range(rounds):
        for k in losses:
            times[k].append(step(k))
    med = {k: statistics.median(v) for k, v in times.items()}
    return {
        "model": name,
        "chunk": chunk,
        "precision": cfg.train.precision,
        "attention": cfg.model.attention,
        "tokens": cfg.train.micro_batch_size * cfg.train_seq_len,
        "median_s": med,
        "min_s": {k: min(v) for k, v in times.items()},
        "times_s": times,
        "compile_s": first["compiled"] - med["compiled"],
        "loss": values,
    }


def masked_softmax_grad(logits_cV, safe_t, valid_c1, n_valid: int, out_dtype):
    """The compiled kernel's first form: padding masked to -inf in every pass."""
    x_cV = logits_cV.float()
    cols_V = torch.arange(x_cV.shape[1], device=x_cV.device)
    if n_valid < x_cV.shape[1]:
        x_cV = x_cV.masked_fill(cols_V >= n_valid, float("-inf"))
    max_c1 = x_cV.amax(dim=1, keepdim=True)
    exp_cV = (x_cV - max_c1).exp()
    sum_c1 = exp_cV.sum(dim=1, keepdim=True)
    valid_c1 = valid_c1.to(torch.float32)
    loss = ((max_c1 + sum_c1.log() - x_cV.gather(1, safe_t)) * valid_c1).sum()
    g_cV = exp_cV / sum_c1 - (cols_V == safe_t).to(torch.float32) * valid_c1
    return loss, g_cV.to(out_dtype)


def aten_softmax_grad(logits_cV, safe_t, valid_c1, n_valid: int, out_dtype):
    """The eager path's chunk math (chunked_loss.py): fp32 copy, padding filled, ATen's softmax."""
    x_cV = logits_cV.float()
    x_cV[:, n_valid:] = float("-inf")
    loss, g_cV = _softmax_grad(x_cV, safe_t, valid_c1)
    return loss, g_cV.to(out_dtype)


def softmax_kernels(name: str, rounds: int) -> dict:
    """The chunk's softmax gradient alone at the model's chunk shape, interleaved, medians."""
    built = _model(name)
    cfg = built.cfg
    chunk, vocab, n_valid = cfg.memory.loss_chunk, cfg.model.padded_vocab, cfg.model.vocab_size
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(chunk, vocab, generator=g).to(built.policy.compute_dtype)
    t = torch.randint(0, n_valid, (chunk, 1), generator=g)
    valid = torch.ones(chunk, 1, dtype=torch.bool)
    kernels = {
        "aten": aten_softmax_grad,
        "compiled": torch.compile(softmax_grad, dynamic=False),
        "compiled, padding masked every pass": torch.compile(masked_softmax_grad, dynamic=False),
        "C++ (loss_kernel_cpu)": loss_kernel_cpu.softmax_grad,
    }
    times: dict[str, list[float]] = {k: [] for k in kernels}
    for r in range(rounds + 2):  # two warm-up rounds (the compiled ones compile)
        for k, fn in kernels.items():
            t0 = time.perf_counter()
            fn(logits, t, valid, n_valid, built.policy.compute_dtype)
            if r >= 2:
                times[k].append(time.perf_counter() - t0)
    return {"model": name, "chunk": chunk, "vocab": vocab, "n_valid": n_valid,
            "median_s": {k: statistics.median(v) for k, v in times.items()}}  # fmt: skip


def softmax_table(rows: list[dict]) -> str:
    lines = [
        "",
        "The chunk's softmax gradient alone (forward of the chunk math, logits given), "
        "interleaved, medians:",
        "",
        "| model | chunk x padded vocab (valid) | " + " | ".join(rows[0]["median_s"]) + " |",
        "|---|---|" + "---|" * len(rows[0]["median_s"]),
    ]
    for r in rows:
        cells = " | ".join(f"{s * 1e3:.1f} ms" for s in r["median_s"].values())
        lines.append(
            f"| {r['model']} | {r['chunk']} x {r['vocab']:,} ({r['n_valid']:,}) | {cells} |"
        )
    return "\n".join(lines) + "\n"


def table(rows: list[dict], a: argparse.Namespace) -> str:
    lines = [
        "# The chunked loss's compiled kernels against ATen's, in the real model's step",
        "",
        f"`python benchmarks/loss_kernels.py --models {a.models} --rounds {a.rounds}"
        f"{' --softmax' if a.softmax else ''}`; "
        f"{os.cpu_count()} cores ({cpu_identity()}), torch {torch.__version__}, allocator "
        f"{active_allocator()}; {time.strftime('%Y-%m-%d')}. One micro-batch's forward + "
        f"backward, ATen's loss kernels and the compiled ones alternately in one process, "
        f"{a.rounds} times each; medians (min in brackets).",
        "",
        "| model | precision | attention | loss chunk | ATen kernels | compiled | saved | "
        "x | first compile | loss (ATen / compiled) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if not r["chunk"]:
            lines.append(f"| {r['model']} | - | - | off: nothing to compile | | | | | | |")
            continue
        e, c = r["median_s"]["eager"], r["median_s"]["compiled"]
        lines.append(
            f"| {r['model']} | {r['precision']} | {r['attention']} | {r['chunk']} "
            f"| {e * 1e3:,.0f} ms ({r['min_s']['eager'] * 1e3:,.0f}) "
            f"| {c * 1e3:,.0f} ms ({r['min_s']['compiled'] * 1e3:,.0f}) "
            f"| {(e - c) * 1e3:,.0f} ms | {e / c:.3f} | {r['compile_s']:.1f} s "
            f"| {r['loss']['eager']:.6f} / {r['loss']['compiled']:.6f} |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--models", default="A,B")
    ap.add_argument("--rounds", type=int, default=12)
    ap.add_argument("--softmax", action="store_true", help="also the softmax kernel alone")
    a = ap.parse_args()
    rows = [measure(m, a.rounds) for m in a.models.split(",")]
    text = table(rows, a)
    if a.softmax:
        kernels = [softmax_kernels(m, a.rounds) for m in a.models.split(",")]
        text += softmax_table(kernels)
        rows += kernels
    print(text)
    stem = _new_stem(f"loss-kernels-{time.strftime('%Y-%m-%d')}")
    (RESULTS / f"{stem}.md").write_text(text)
    (RESULTS / f"{stem}.json").write_text(json.dumps(rows, indent=1))
    print(f"wrote {RESULTS / stem}.md")


if __name__ == "__main__":
    main()
