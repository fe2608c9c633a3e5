"""Everything a JAX run needs before its first step: data, model, parameters (from the seed
or model.init_from), optimizer and the jitted step."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from onegpu.backends.jax import weights
from onegpu.backends.jax.loss import make_loss
from onegpu.backends.jax.loss_chunk import resolve_loss_chunk
from onegpu.backends.jax.model import GPT, Precision, precision_for
from onegpu.backends.jax.precision import bf16_pays
from onegpu.backends.jax.step import make_eval_step, make_optimizer, make_train_step
from onegpu.backends.jax.xla_flags import XlaFlags, apply_xla_flags
from onegpu.config import Config
from onegpu.config.data_checks import check_data_sizes
from onegpu.data.splits import TokenSplits
from onegpu.data.tokens import prepare_tokens
from onegpu.perf.logits import padded_vocab


@dataclass
class JaxBuilt:
    cfg: Config
    data: TokenSplits
    precision: Precision
    model: GPT
    params: Any
    tx: Any
    opt_state: Any
    step: Any
    evaluate: Any
    n_params: int
    flops_per_token: int
    xla: XlaFlags

    @property
    def n_micro(self) -> int:
        return self.cfg.train.batch_size // self.cfg.train.micro_batch_size


def flops_per_token(cfg: Config) -> int:
    """As perf/flops.py counts the torch model: 6 per matmul weight (the output layer without
    its padding) plus attention's 12 * n_layer * seq_len * d_model."""
    m = cfg.model
    D, F = m.d_model, m.mlp_ratio * m.d_model
    matmul = m.n_layer * (4 * D * D + 2 * D * F) + m.vocab_size * D
    return 6 * matmul + 12 * m.n_layer * cfg.train_seq_len * D


def init_params(cfg: Config, model: GPT) -> Any:
    """GPT-2's initialisation from train.seed (JAX's generator: not the torch run's draws;
    model.init_from gives both backends the same weights), vocabulary padding rows zero."""
    m = cfg.model
    x = jnp.zeros((1, cfg.train_seq_len), jnp.int32)
    params = jax.jit(lambda k: model.init(k, x)["params"])(jax.random.key(cfg.train.seed))
    params = dict(params)
    params["wte"] = params["wte"].at[m.vocab_size :].set(0)
    if "lm_head" in params:
        head = dict(params["lm_head"])
        head["weight"] = head["weight"].at[m.vocab_size :].set(0)
        params["lm_head"] = head
    if m.init_from:
        state = weights.load_safetensors(m.init_from)
        params = weights.from_torch_names(state, jax.device_get(params), m, m.init_from)
        params = jax.tree_util.tree_map(jnp.asarray, params)
    return params


def count_params(params: Any, cfg: Config) -> int:
    """Parameters, vocabulary padding left out (as the torch backend counts)."""
    m = cfg.model
    total = sum(int(np.prod(p.shape)) for p in jax.tree_util.tree_leaves(params))
    rows = padded_vocab(m) - m.vocab_size
    head = 0 if m.tie_embeddings else rows * (m.d_model + m.bias)
    return total - rows * m.d_model - head


def build(cfg: Config) -> JaxBuilt:
    cfg, xla = apply_xla_flags(cfg)  # first: XLA reads its flags when it starts
    data = prepare_tokens(cfg.data, cfg.model.vocab_size)
    data.cut(cfg.data, cfg.train_seq_len)
    check_data_sizes(cfg, len(data.train_rows), len(data.val_rows))
    precision = precision_for(cfg, bf16_pays(cfg) if cfg.train.precision == "auto" else False)
    # what ran, not `auto`: config.toml and checkpoints hold the measured choice, so a resume
    # on another machine continues it (runs/checkpoints.keep_decisions) instead of re-deciding
    cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, precision=precision.name))
    tokens = cfg.train.micro_batch_size * cfg.train_seq_len
    chunk = resolve_loss_chunk(cfg.memory.loss_chunk, cfg.model, tokens, precision.compute_dtype)
    cfg = dataclasses.replace(cfg, memory=dataclasses.replace(cfg.memory, loss_chunk=chunk))
    model = GPT(cfg.model, precision, cfg.memory.checkpointing, cfg.model.scan_layers)
    loss = make_loss(model, cfg, chunk)
    params = init_params(cfg, model)
    tx = make_optimizer(cfg.optim, params)
    opt_state = tx.init(jax.tree_util.tree_map(lambda p: p.astype(jnp.float32), params))
    return JaxBuilt(
        cfg=cfg,
        data=data,
        precision=precision,
        model=model,
        params=params,
        tx=tx,
        opt_state=opt_state,
        step=make_train_step(loss, tx, cfg),
        evaluate=make_eval_step(loss),
        n_params=count_params(params, cfg),
        flops_per_token=flops_per_token(cfg),
        xla=xla,
    )
