"""The loss of one micro-batch on JAX: summed token cross-entropy (divided by the whole batch's
target count in backends/torch/step.py), plain or through the chunked output layer.

The chunked one is the torch backend's (techniques/chunked_loss.py) as a `jax.custom_vjp`: over
chunks of `memory.loss_chunk` tokens, under one `lax.scan`, each chunk's logits give their loss
and, at once, their gradient (softmax - onehot) turned into the hidden states' and the output
weight's gradients; backward only scales them. No [tokens, vocab] tensor is kept for backward
and none is recomputed.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from onegpu.config import Config
from onegpu.data.windows import IGNORE_INDEX


def token_loss_sum(logits_BTV: jax.Array, targets_BT: jax.Array) -> jax.Array:
    """Sum of cross-entropy over targets != IGNORE_INDEX, in fp32."""
    logp = jax.nn.log_softmax(logits_BTV.astype(jnp.float32), axis=-1)
    valid = targets_BT != IGNORE_INDEX
    picked = jnp.take_along_axis(logp, jnp.where(valid, targets_BT, 0)[..., None], -1)[..., 0]
    return -jnp.sum(jnp.where(valid, picked, 0.0))


def _forward(chunk: int, compute: Any, n_valid: int, h_ND, w_VD, b_V, t_N):
    """(summed loss, its gradients with respect to h, w and b)."""
    N, D = h_ND.shape
    pad = -N % chunk
    h = jnp.pad(h_ND, ((0, pad), (0, 0))).reshape(-1, chunk, D)
    t = jnp.pad(t_N, (0, pad), constant_values=IGNORE_INDEX).reshape(-1, chunk)
    w = w_VD.astype(compute)
    V = w_VD.shape[0]
    padding = jnp.arange(V) >= n_valid

    def body(carry, xs):
        loss, gw, gb = carry
        h_cD, t_c = xs
        valid_c = t_c != IGNORE_INDEX
        # ignored tokens are masked on the [chunk, d_model] side: their rows are zeroed for the
        # weight gradient and in the hidden-state gradient
        h_cD = h_cD.astype(compute) * valid_c[:, None].astype(compute)
        logits = (h_cD @ w.T).astype(jnp.float32) + b_V.astype(jnp.float32)
        logits = jnp.where(padding, -jnp.inf, logits)
        lse = jax.nn.logsumexp(logits, axis=-1)
        picked = jnp.take_along_axis(logits, jnp.where(valid_c, t_c, 0)[:, None], -1)[:, 0]
        loss = loss + jnp.sum(jnp.where(valid_c, lse - picked, 0.0))
        g = jnp.exp(logits - lse[:, None])
        g = g - jax.nn.one_hot(jnp.where(valid_c, t_c, 0), V, dtype=g.dtype)
        g = g * valid_c[:, None]
        gb = gb + g.sum(0)
        g = g.astype(compute)
        gh = (g @ w) * valid_c[:, None].astype(compute)
        gw = gw + (g.T @ h_cD).astype(jnp.float32)
        return (loss, gw, gb), gh

    init = (
        jnp.zeros((), jnp.float32),
        jnp.zeros(w_VD.shape, jnp.float32),
        jnp.zeros(b_V.shape, jnp.float32),
    )
    (loss, gw, gb), gh = jax.lax.scan(body, init, (h, t))
    gh = gh.reshape(-1, D)[:N].astype(h_ND.dtype)
    return loss, (gh, gw, gb)


@partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2))
def chunked_loss_sum(chunk: int, compute: Any, n_valid: int, h_ND, w_VD, b_V, t_N):
    """Sum of cross-entropy over targets != IGNORE_INDEX of the logits h @ w.T + b, whose
    columns from `n_valid` on (vocabulary padding) are -inf; matmuls in `compute`, softmax fp32."""
    return _forward(chunk, compute, n_valid, h_ND, w_VD, b_V, t_N)[0]


def _fwd(chunk, compute, n_valid, h_ND, w_VD, b_V, t_N):
    loss, grads = _forward(chunk, compute, n_valid, h_ND, w_VD, b_V, t_N)
    # residuals are arrays: empty ones carry the weight's and bias's dtypes
    return loss, (grads, jnp.zeros((0,), w_VD.dtype), jnp.zeros((0,), b_V.dtype), t_N)


def _bwd(chunk, compute, n_valid, res, g):
    (gh, gw, gb), w_like, b_like, t_N = res
    no_grad = np.zeros(t_N.shape, jax.dtypes.float0)  # integer targets: a float0 cotangent
    return (
        (gh * g.astype(gh.dtype)),
        (gw * g).astype(w_like.dtype),
        (gb * g).astype(b_like.dtype),
        no_grad,
    )


chunked_loss_sum.defvjp(_fwd, _bwd)


def make_loss(model: Any, cfg: Config, chunk: int) -> Callable:
    """loss(params, x, y, key, deterministic, positions=None) -> the micro-batch's summed
    token loss; `model` the GPT, whose `hidden` twin gives the final hidden states when
    `chunk` > 0; `positions`: rows of packed documents."""
    m = cfg.model

    def run(module, params, x, key, deterministic, positions):
        return module.apply(
            {"params": params},
            x,
            deterministic=deterministic,
            positions_BT=positions,
            rngs={"dropout": key},
        )

    def plain(params, x, y, key, deterministic, positions=None):
        return token_loss_sum(run(model, params, x, key, deterministic, positions), y)

    if not chunk:
        return plain
    hidden = model.clone(logits=False)

    def chunked(params, x, y, key, deterministic, positions=None):
        h = run(hidden, params, x, key, deterministic, positions)
        head = params.get("lm_head", {})
        w = params["wte"] if m.tie_embeddings else head["weight"]
        b = head["bias"] if "bias" in head else jnp.zeros(w.shape[:1], jnp.float32)
        return chunked_loss_sum(
            chunk,
            model.p.compute_dtype,
            m.vocab_size,
            h.reshape(-1, h.shape[-1]),
            w,
            b,
            y.reshape(-1),
        )

    return chunked
