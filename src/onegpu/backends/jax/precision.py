"""`train.precision auto` on JAX: bf16 where XLA multiplies bf16 faster than fp32 here.

On accelerators it does. On CPUs it depends on the machine and on XLA's CPU path: on a 2-core
AVX512-BF16 EPYC, XLA's default bf16 dot ran at 0.86x its fp32 one and a bf16 training step
was slower than an fp32 one (benchmarks/results/xla-cpu-flags-bf16cpu.md), where torch's
oneDNN runs bf16 2.1x faster. So on a CPU `auto` times the step's main products (the MLP's
forward and its two backward products, at the run's shape) in both dtypes, once per machine,
jax version, XLA_FLAGS and shape (cached), and takes bf16 only where it is clearly faster.
"""

from __future__ import annotations

import time
from typing import Any

import jax
import jax.numpy as jnp

from onegpu.backends.jax.xla_flags import machine_key
from onegpu.cache import has
from onegpu.config import Config
from onegpu.perf.contention import timed_cached

BF16_MARGIN = 1.1
"""bf16 must run the products this much faster than fp32: the rest of a bf16 step (casts,
fp32 softmax and loss) costs more than an fp32 one's."""


def _products_s(shape: tuple[int, int, int], dtype: Any, repeats: int = 5) -> float:
    """The best time of the MLP's forward product and its two backward ones in `dtype`."""
    n, d, f = shape
    x = jnp.ones((n, d), dtype)
    w = jnp.ones((d, f), dtype)
    g = jnp.ones((n, f), dtype)
    step = jax.jit(lambda x, w, g: (x @ w, g @ w.T, x.T @ g))
    jax.block_until_ready(step(x, w, g))  # compile and warm up
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(step(x, w, g))
        times.append(time.perf_counter() - t0)
    return min(times)


def measure_products(shape: tuple[int, int, int]) -> dict[str, float]:
    return {"fp32_s": _products_s(shape, jnp.float32), "bf16_s": _products_s(shape, jnp.bfloat16)}


def products_shape(cfg: Config) -> tuple[int, int, int]:
    """(tokens of a micro-batch, d_model, the MLP's width): the step's largest repeated GEMM."""
    m = cfg.model
    return cfg.train.micro_batch_size * cfg.train_seq_len, m.d_model, m.mlp_ratio * m.d_model


def bf16_pays(cfg: Config) -> bool:
    """Whether `auto` precision is bf16 on this device (see the module's docstring)."""
    if jax.default_backend() != "cpu":
        return True
    shape = products_shape(cfg)
    key = f"{machine_key()}|{list(shape)}"
    found = timed_cached(
        "jax-precision.json",
        key,
        lambda: measure_products(shape),
        what="fp32 against bf16 products (jax precision auto)",
        valid=has("fp32_s", "bf16_s"),
    )
    return found["fp32_s"] >= BF16_MARGIN * found["bf16_s"]
