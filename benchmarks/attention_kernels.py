"""Causal attention kernels alone, forward + backward a layer, at the shapes of models A and B
and longer ones: torch's CPU flash kernel (sdpa), the plain matmul attention and `blocked`.

    python benchmarks/attention_kernels.py [--rounds 7] [--dtype bfloat16]

Runs itself again under the allocator `onegpu` preloads (mimalloc, freed pages kept): the
kernels' large temporaries would otherwise time page faults (docs/cpu-notes.md). Rounds are
interleaved; medians are compared. Also reports each kernel's error against fp64 SDPA (the
output's and the worst gradient's, relative to their largest value) and the bytes a layer
keeps for backward. Writes results/attention-kernels-<date>.{md,json} (never over an
earlier file).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from onegpu.models.blocked_attention import blocked_attention
from onegpu.models.gpt import plain_attention
from onegpu.perf.allocator import MIMALLOC_PURGE, find_mimalloc
from onegpu.perf.attention_blocks import query_blocks
from onegpu.perf.devices import cpu_identity

sys.path.insert(0, str(Path(__file__).parent))
from vs_peers import RESULTS, _new_stem  # noqa: E402

SHAPES = {  # batch, heads, sequence, head dim
    "B": (16, 6, 256, 64),
    "A": (8, 4, 512, 64),
    "seq 1024": (2, 8, 1024, 64),
    "head 128": (4, 8, 512, 128),
}
KERNELS = {
    "sdpa": lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True),
    "plain": plain_attention,
    "blocked": blocked_attention,
}


def _inputs(shape, dtype, seed=0):
    B, H, T, K = shape
    g = torch.Generator().manual_seed(seed)
    qkv = [torch.randn(B, T, H, K, generator=g).to(dtype).transpose(1, 2) for _ in range(3)]
    return [x.requires_grad_() for x in qkv], torch.randn(B, H, T, K, generator=g).to(dtype)


def _errors(kernel, shape, dtype) -> tuple[float, float]:
    (q, k, v), dy = _inputs(shape, dtype)
    ref_in = [x.detach().double().requires_grad_() for x in (q, k, v)]
    ref = F.scaled_dot_product_attention(*ref_in, is_causal=True)
    ref.backward(dy.double())
    y = kernel(q, k, v)
    y.backward(dy)

    def rel(a, b):
        return ((a.double() - b).abs().max() / b.abs().max()).item()

    grads = [rel(a.grad, b.grad) for a, b in zip((q, k, v), ref_in, strict=True)]
    return rel(y, ref), max(grads)


def _saved_bytes(kernel, shape, dtype) -> int:
    """Every storage a layer keeps for backward, once (q, k, v or the kernel's copies of them
    included)."""
    (q, k, v), _ = _inputs(shape, dtype)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        kernel(q, k, v)
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in saved}
    return sum(storages.values())


def _time(kernel, q, k, v, dy) -> float:
    for x in (q, k, v):
        x.grad = None
    t0 = time.perf_counter()
    kernel(q, k, v).backward(dy)
    return time.perf_counter() - t0


def measure(shape, dtype, rounds: int) -> dict[str, dict]:
    (q, k, v), dy = _inputs(shape, dtype)
    times: dict[str, list[float]] = {name: [] for name in KERNELS}
    for kernel in KERNELS.values():  # warm-up
        _time(kernel, q, k, v, dy)
    for _ in range(rounds):
        for name, kernel in KERNELS.items():
            times[name].append(_time(kernel, q, k, v, dy))
    out = {}
    for name, kernel in KERNELS.items():
        err_y, err_grad = _errors(kernel, shape, dtype)
        out[name] = {
            "ms": 1e3 * statistics.median(times[name]),
            "spread_ms": 1e3 * (max(times[name]) - min(times[name])),
            "err_out": err_y,
            "err_grad": err_grad,
            "saved_bytes": _saved_bytes(kernel, shape, dtype),
        }
    return out


def table(results: dict, a: argparse.Namespace) -> str:
    lines = [
        "# Causal attention kernels alone: forward + backward a layer",
        "",
        f"`python benchmarks/attention_kernels.py --rounds {a.rounds} --dtype {a.dtype}`; "
        f"{os.cpu_count()} cores ({cpu_identity()}), torch {torch.__version__}, "
        f"{torch.get_num_threads()} threads, allocator {os.environ.get('ONEGPU_BENCH_ALLOC')}; "
        f"{time.strftime('%Y-%m-%d')}; medians of {a.rounds} interleaved rounds. Error: max "
        "|error| against fp64 SDPA relative to the largest value, of the output and of the "
        "worst of the three gradients. Saved: every storage a layer keeps for backward, once "
        "(q, k, v included: 3 x B x T x H x K x 2 bytes).",
        "",
        "| shape (B, H, T, K) | kernel | ms | x sdpa | spread | error out | error grad | saved |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for label, rows in results.items():
        shape = SHAPES[label]
        base = rows["sdpa"]["ms"]
        blocks = len(query_blocks(shape[2]))
        for name, r in rows.items():
            what = f"{name} ({blocks} blocks)" if name == "blocked" else name
            lines.append(
                f"| {label} {shape} | {what} | {r['ms']:.1f} | {base / r['ms']:.2f} "
                f"| {r['spread_ms']:.1f} | {r['err_out']:.1e} | {r['err_grad']:.1e} "
                f"| {r['saved_bytes'] / 2**20:.1f} MiB |"
            )
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--only", default=",".join(SHAPES), help=f"of {','.join(SHAPES)}")
    a = ap.parse_args()
    lib = find_mimalloc()
    if lib and "ONEGPU_BENCH_ALLOC" not in os.environ:  # once, as `onegpu` runs
        env = {**os.environ, "LD_PRELOAD": lib, MIMALLOC_PURGE: "-1"}
        os.execve(
            sys.executable, [sys.executable, *sys.argv], env | {"ONEGPU_BENCH_ALLOC": "mimalloc"}
        )
    os.environ.setdefault("ONEGPU_BENCH_ALLOC", "system")
    dtype = getattr(torch, a.dtype)
    results = {}
    for label in a.only.split(","):
        results[label] = measure(SHAPES[label], dtype, a.rounds)
        print(label, {k: round(v["ms"], 1) for k, v in results[label].items()}, flush=True)
    text = table(results, a)
    stem = _new_stem(f"attention-kernels-{a.dtype}-{time.strftime('%Y-%m-%d')}")
    (RESULTS / f"{stem}.md").write_text(text)
    (RESULTS / f"{stem}.json").write_text(json.dumps(results, indent=1))
    print(text)


if __name__ == "__main__":
    main()
