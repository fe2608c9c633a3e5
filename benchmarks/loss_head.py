"""Output layer + cross-entropy, forward and backward, at models A and B's shapes (fp32):
plain (`F.cross_entropy` on the full logits) against the chunked loss, interleaved, minimum of
5 rounds after a warm-up. Run it under the allocator `onegpu` runs with, e.g.

    LD_PRELOAD=$(python -c "from onegpu.perf.allocator import find_mimalloc as f; print(f())") \\
        MIMALLOC_PURGE_DELAY=-1 python benchmarks/loss_head.py

Writes results/loss-head.md.
"""

from __future__ import annotations

import platform
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from onegpu.perf.devices import cpu_identity
from onegpu.techniques.chunked_loss import ChunkedLinearCrossEntropy

# (name, tokens, d_model, padded vocab, vocab, chunk `auto` chose)
SHAPES = [("A", 4096, 256, 50304, 50257, 2048), ("B", 4096, 384, 8192, 8192, 4096)]


def main() -> None:
    torch.manual_seed(0)
    lines = [
        "# Output layer + loss, forward + backward (fp32)",
        "",
        f"`python benchmarks/loss_head.py`; {platform.machine()}, {torch.get_num_threads()} "
        f"threads ({cpu_identity()}), torch {torch.__version__}; min of 5 interleaved rounds.",
        "",
        "| model | tokens x d x vocab | plain | chunked (chunk) | chunked / plain |",
        "|---|---|---|---|---|",
    ]
    for name, n, d, v, n_valid, chunk in SHAPES:
        h = torch.randn(n, d, requires_grad=True)
        w = (torch.randn(v, d) * 0.02).requires_grad_()
        t = torch.randint(0, n_valid, (n,))

        def plain(h=h, w=w, t=t, n_valid=n_valid) -> torch.Tensor:
            return F.cross_entropy((h @ w.T)[:, :n_valid], t, reduction="sum")

        def chunked(h=h, w=w, t=t, chunk=chunk, n_valid=n_valid) -> torch.Tensor:
            return ChunkedLinearCrossEntropy.apply(h, w, None, t, chunk, torch.float32, n_valid)

        times: dict[str, list[float]] = {"plain": [], "chunked": []}
        for _ in range(6):
            for k, fn in (("plain", plain), ("chunked", chunked)):
                t0 = time.perf_counter()
                fn().backward()
                times[k].append(time.perf_counter() - t0)
                h.grad = w.grad = None
        p, c = min(times["plain"][1:]), min(times["chunked"][1:])
        lines.append(f"| {name} | {n} x {d} x {n_valid:,} | {p:.3f} s | {c:.3f} s ({chunk}) "
                     f"| {c / p:.2f} |")  # fmt: skip
    text = "\n".join(lines) + "\n"
    out = Path(__file__).parent / "results" / "loss-head.md"
    out.write_text(text)
    print(text)


if __name__ == "__main__":
    main()
