"""`memory.loss_chunk auto` on JAX: the torch backend's rule (perf/logits.py): chunk only where
the logits are large, then the smallest chunk size within 5% of the fastest contestant, timed
here once per shape and cached (`loss_chunk.json`, keys that start with `jax|`)."""

from __future__ import annotations

import time
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp

from onegpu.backends.jax.loss import chunked_loss_sum, token_loss_sum
from onegpu.backends.jax.xla_flags import machine_key
from onegpu.config import ModelConfig
from onegpu.perf.contention import timed_cached
from onegpu.perf.logits import (
    CHUNK_SIZES,
    chosen_chunk,
    leanest_within_margin,
    padded_vocab,
    valid_timings,
    worth_chunking,
)


def resolve_loss_chunk(value: int | str, m: ModelConfig, tokens: int, compute: Any) -> int:
    """The chunk size `memory.loss_chunk` stands for on JAX: itself unless 'auto' (see the
    module's docstring)."""
    if value != "auto":
        return int(value)
    if not worth_chunking(m, tokens, jnp.dtype(compute).itemsize):
        return 0
    vocab = padded_vocab(m)
    device = jax.devices()[0]
    # on a CPU the time depends on the CPU, its threads and XLA_FLAGS, not just "cpu"
    where = machine_key() if device.platform == "cpu" else device.device_kind
    key = (
        f"jax|{device.platform}|{where}|{jnp.dtype(compute).name}|"
        f"tokens={tokens}|d={m.d_model}|vocab={vocab}"
    )
    found = timed_cached(
        "loss_chunk.json",
        key,
        lambda: measure_loss_chunk(tokens, m.d_model, vocab, compute),
        what="the loss chunk (jax)",
        valid=valid_timings,
    )
    return chosen_chunk(found, tokens)


def measure_loss_chunk(tokens: int, d_model: int, vocab: int, compute: Any) -> dict[str, Any]:
    """Output layer + loss, forward and backward, jitted: plain and per chunk size, interleaved,
    the minimum of 3 rounds each after one that compiles."""
    k1, k2, k3 = jax.random.split(jax.random.key(0), 3)
    h = jax.random.normal(k1, (tokens, d_model), jnp.float32).astype(compute)
    w = jax.random.normal(k2, (vocab, d_model), jnp.float32) * 0.02
    b = jnp.zeros((vocab,), jnp.float32)
    t = jax.random.randint(k3, (tokens,), 0, vocab)

    def plain(h, w, b, t):
        return token_loss_sum((h.astype(compute) @ w.astype(compute).T)[None] + b, t[None])

    def chunked(c):
        return partial(chunked_loss_sum, c, compute, vocab)

    contestants = {0: plain} | {c: chunked(c) for c in CHUNK_SIZES if c < tokens}
    grads = {c: jax.jit(jax.grad(fn, argnums=(0, 1))) for c, fn in contestants.items()}
    times: dict[int, list[float]] = {c: [] for c in contestants}
    for _ in range(4):
        for c, fn in grads.items():
            t0 = time.perf_counter()
            jax.block_until_ready(fn(h, w, b, t))
            times[c].append(time.perf_counter() - t0)
    seconds = {str(c): round(min(ts[1:]), 5) for c, ts in times.items()}
    return {"chunk": leanest_within_margin(seconds), "seconds": seconds}
