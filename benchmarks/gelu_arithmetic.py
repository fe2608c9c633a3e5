"""What the compiled GELU's forward spends its time on: the exponentials, or the rest.

B's GELU (GPT-2's tanh form, written x * sigmoid(2u) for inductor) runs over a [4,096, 1,536]
bf16 activation, 6 times forward and 6 times backward a step; its kernels are compute-bound on
two cores, not memory-bound. Here the same forward, hand-written in C++ with ATen's vectorised
ops (the ones inductor's kernel calls), is timed whole and with parts taken out, beside
inductor's own kernel, on one thread and on all of them, in interleaved rounds:

- `sleef exp, divide`: as inductor writes it (Sleef's exponential, 1 ulp; a true division);
- `exp_u20, divide`: ATen's faster exponential (changes bits);
- `sleef exp, reciprocal`: rcp14 and one Newton step instead of the division (changes bits);
- `no exp, divide`: the exponential left out (not the GELU: what the rest costs).

`bf16 outputs unlike inductor's` counts, over one standard normal input, the outputs that differ
from inductor's kernel: a sample, not a proof that a variant keeps the bits.

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4 \\
        python benchmarks/gelu_arithmetic.py [--rounds 5]

Writes results/gelu-arithmetic-<date>.{md,json} (never over an earlier file). Needs an AVX512
CPU (the reciprocal variant uses its rcp14).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

from onegpu.models.gpt import tanh_gelu_sigmoid_form
from onegpu.perf.allocator import active_allocator
from onegpu.perf.devices import cpu_identity
from onegpu.techniques.cpu_extension import ISA_FLAGS

sys.path.insert(0, str(Path(__file__).parent))
from records import write_table  # noqa: E402

SHAPE = (4096, 1536)
SOURCE = r"""
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/vec.h>
#include <immintrin.h>

using V = at::vec::Vectorized<float>;
using B = at::vec::Vectorized<at::BFloat16>;

// EXP: 0 Sleef (V::exp), 1 V::exp_u20, 2 none. DIV: 0 division, 1 rcp14 + one Newton step.
template <int EXP, int DIV>
void gelu_forward(const at::BFloat16* x, at::BFloat16* y, int64_t n) {
  at::parallel_for(0, n / 32, 256, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin * 32; i < end * 32; i += 32) {
      auto [lo, hi] = at::vec::convert_bfloat16_float(B::loadu(x + i));
      V halves[2] = {lo, hi};
      for (auto& v : halves) {
        V u2 = (v + V(0.044715f) * v * v * v) * V(1.5957691216057308f);
        V e = EXP == 0 ? u2.neg().exp() : (EXP == 1 ? u2.neg().exp_u20() : u2.neg());
        V den = V(1.f) + e;
        V s;
        if constexpr (DIV == 0) {
          s = V(1.f) / den;
        } else {
          V r(_mm512_rcp14_ps(den));
          s = r * (V(2.f) - den * r);
        }
        v = v * s;
      }
      at::vec::convert_float_bfloat16(halves[0], halves[1]).store(y + i);
    }
  });
}

torch::Tensor forward(torch::Tensor x, int64_t exp_kind, int64_t div_kind) {
  TORCH_CHECK(x.is_contiguous() && x.scalar_type() == at::kBFloat16 && x.numel() % 32 == 0);
  auto y = torch::empty_like(x);
  auto* in = x.data_ptr<at::BFloat16>();
  auto* out = y.data_ptr<at::BFloat16>();
  auto n = x.numel();
  if (exp_kind == 0 && div_kind == 0) gelu_forward<0, 0>(in, out, n);
  else if (exp_kind == 1 && div_kind == 0) gelu_forward<1, 0>(in, out, n);
  else if (exp_kind == 0 && div_kind == 1) gelu_forward<0, 1>(in, out, n);
  else if (exp_kind == 2 && div_kind == 0) gelu_forward<2, 0>(in, out, n);
  else TORCH_CHECK(false, "no such variant: exp ", exp_kind, ", division ", div_kind);
  return y;
}
"""
VARIANTS = {
    "sleef exp, divide": (0, 0),
    "exp_u20, divide": (1, 0),
    "sleef exp, reciprocal": (0, 1),
    "no exp, divide": (2, 0),
}


def build():
    from torch.utils.cpp_extension import load_inline

    if torch.backends.cpu.get_cpu_capability() != "AVX512":
        raise SystemExit("gelu_arithmetic: needs a CPU torch runs at its AVX512 level")
    return load_inline(
        name="onegpu_bench_gelu_arithmetic",
        cpp_sources=[SOURCE],
        functions=["forward"],
        extra_cflags=["-O3", "-fopenmp", *ISA_FLAGS["AVX512"]],
        extra_ldflags=["-fopenmp"],
    )


def median_ms(fn: Callable[[], object], calls: int = 20) -> float:
    fn()
    times = []
    for _ in range(calls):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    ext = build()
    inductor = torch.compile(tanh_gelu_sigmoid_form)
    x = torch.randn(SHAPE).bfloat16()
    reference = inductor(x)
    contestants: dict[str, Callable[[], object]] = {"inductor's kernel": lambda: inductor(x)}
    for name, (e, d) in VARIANTS.items():
        contestants[f"C++: {name}"] = lambda e=e, d=d: ext.forward(x, e, d)
    all_threads = torch.get_num_threads()
    times = {(n, t): [] for n in contestants for t in (1, all_threads)}
    for _ in range(args.rounds):
        for threads in (1, all_threads):
            torch.set_num_threads(threads)
            for name, fn in contestants.items():
                times[name, threads].append(median_ms(fn))
    torch.set_num_threads(all_threads)
    rows = []
    for name, fn in contestants.items():
        out = fn()
        rows.append(
            {
                "kernel": name,
                "1 thread ms": statistics.median(times[name, 1]),
                f"{all_threads} threads ms": statistics.median(times[name, all_threads]),
                "bf16 outputs unlike inductor's": int((out != reference).sum()),
            }
        )
        print(rows[-1], flush=True)
    write(rows, args, all_threads)


def write(rows: list[dict], args: argparse.Namespace, threads: int) -> None:
    command = f"python benchmarks/gelu_arithmetic.py --rounds {args.rounds}"
    head = (
        f"# The compiled GELU's forward: exponentials against the rest\n\n`{command}`; "
        f"{cpu_identity()}, torch {torch.__version__}, allocator {active_allocator()}; "
        f"{time.strftime('%Y-%m-%d')}; a [{SHAPE[0]:,}, {SHAPE[1]:,}] bf16 input, "
        f"{SHAPE[0] * SHAPE[1]:,} elements; medians over {args.rounds} interleaved rounds.\n\n"
    )
    columns = list(rows[0])
    cells = [
        [r["kernel"], *(f"{r[c]:.2f}" for c in columns[1:3]), f"{r[columns[3]]:,}"] for r in rows
    ]
    write_table("gelu-arithmetic", head, columns, cells, {"command": command, "rows": rows})


if __name__ == "__main__":
    main()
