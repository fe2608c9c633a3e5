"""The JAX training step: micro-batches accumulated under one `jax.lax.scan`, the summed
token loss divided by the whole batch's target count (token-exact, as on torch), clipping by
global norm, the optax update at the scheduled learning rate, and the non-finite guard (a
skipped update leaves parameters and optimizer state as they were). One jitted function,
its buffers donated."""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax

from onegpu.config import Config, OptimConfig
from onegpu.data.windows import IGNORE_INDEX


class StepOut(NamedTuple):
    loss: jax.Array
    grad_norm: jax.Array
    skipped: jax.Array


def decay_mask(params: dict) -> dict:
    """Decay matrices only: not biases, norm gains or embeddings (the torch backend's groups;
    a tied output layer is the embedding)."""
    return jax.tree_util.tree_map_with_path(
        lambda path, leaf: leaf.ndim >= 2 and path[0].key not in ("wte", "wpe"), params
    )


def make_optimizer(o: OptimConfig, params: dict) -> optax.GradientTransformation:
    """AdamW (torch's: decoupled decay, bias-corrected moments, eps outside the sqrt), SGD
    with momentum beta1, or Adafactor; the learning rate is an argument of every step."""

    def build(learning_rate):
        if o.name == "adamw":
            return optax.adamw(
                learning_rate,
                b1=o.beta1,
                b2=o.beta2,
                eps=o.eps,
                weight_decay=o.weight_decay,
                mask=decay_mask,
            )
        if o.name == "sgd":
            return optax.chain(
                optax.add_decayed_weights(o.weight_decay, mask=decay_mask),
                optax.sgd(learning_rate, momentum=o.beta1 or None),
            )
        return optax.adafactor(learning_rate)  # adafactor; adamw8bit is refused on JAX

    return optax.inject_hyperparams(build)(learning_rate=o.lr)


def make_train_step(loss: Callable, tx: optax.GradientTransformation, cfg: Config):
    """step(params, opt_state, x, y, positions, n_tokens, lr, key) -> (params, opt_state,
    StepOut); x, y: [n_micro, micro_batch, T], positions the same or None (rows of one
    document each); `loss` as loss.make_loss builds it."""
    clip = cfg.optim.grad_clip
    no_dropout = cfg.model.dropout == 0
    grad_fn = jax.value_and_grad(lambda p, x, y, k, pos: loss(p, x, y, k, no_dropout, pos))

    def step(params, opt_state, x, y, positions, n_tokens, lr, key):
        denom = jnp.maximum(n_tokens, 1).astype(jnp.float32)
        zeros = jax.tree_util.tree_map(lambda p: jnp.zeros(p.shape, jnp.float32), params)

        def body(carry, xs):
            loss, grads = carry
            xb, yb, k, pos = xs
            part, g = grad_fn(params, xb, yb, k, pos)
            grads = jax.tree_util.tree_map(lambda a, b: a + b.astype(jnp.float32), grads, g)
            return (loss + part, grads), None

        keys = jax.random.split(key, x.shape[0])
        start = (jnp.zeros((), jnp.float32), zeros)
        (loss, grads), _ = jax.lax.scan(body, start, (x, y, keys, positions))
        loss = loss / denom
        grads = jax.tree_util.tree_map(lambda g: g / denom, grads)
        norm = jnp.sqrt(sum(jnp.sum(jnp.square(g)) for g in jax.tree_util.tree_leaves(grads)))
        if clip > 0:  # torch's clip_grad_norm_: scale by clip / (norm + 1e-6) when above
            scale = jnp.minimum(1.0, clip / (norm + 1e-6))
            grads = jax.tree_util.tree_map(lambda g: g * scale, grads)
        opt_state.hyperparams["learning_rate"] = lr
        master = jax.tree_util.tree_map(lambda p: p.astype(jnp.float32), params)
        updates, new_state = tx.update(grads, opt_state, master)
        new_params = optax.apply_updates(master, updates)
        skipped = ~(jnp.isfinite(norm) & jnp.isfinite(loss))
        keep = lambda new, old: jax.tree_util.tree_map(  # noqa: E731
            lambda a, b: jnp.where(skipped, b, a), new, old
        )
        new_params = jax.tree_util.tree_map(
            lambda a, p: a.astype(p.dtype), keep(new_params, params), params
        )
        return new_params, keep(new_state, opt_state), StepOut(loss, norm, skipped)

    return jax.jit(step, donate_argnums=(0, 1))


def make_eval_step(loss: Callable):
    """(summed loss, counted targets) of one validation batch, dropout off."""

    def evaluate(params, x, y, positions=None):
        counted = jnp.sum(y != IGNORE_INDEX)
        return loss(params, x, y, jax.random.key(0), True, positions), counted

    return jax.jit(evaluate)
