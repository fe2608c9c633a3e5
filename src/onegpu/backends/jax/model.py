"""onegpu's GPT in Flax linen, parameter for parameter the torch model's (models/gpt.py):
the same names and [out, in] weight layout, so safetensors move between the backends as they
are. Linen, not NNX: `nn.scan` over the blocks and `nn.remat` with a policy are the forms of
the two JAX source documents (Lippe's tutorial; "NanoGPT with JAX, part 2").

Precision (`Precision`): parameters in `param_dtype`, matmuls in `compute_dtype`, LayerNorm
statistics, the attention softmax (model.softmax_dtype) and the loss in fp32.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import flax.linen as nn
import jax
import jax.numpy as jnp

from onegpu.config import ModelConfig, parse_checkpointing
from onegpu.config.options import Config
from onegpu.perf.logits import padded_vocab


@dataclass(frozen=True)
class Precision:
    name: str
    param_dtype: jnp.dtype
    compute_dtype: jnp.dtype
    softmax_dtype: jnp.dtype


def precision_for(cfg: Config, native_bf16: bool) -> Precision:
    """train.precision on JAX: fp32; bf16 (fp32 parameters, bf16 matmuls); bf16-pure (bf16
    parameters too); auto = bf16 where `native_bf16` says XLA runs it faster (precision.py)."""
    name = cfg.train.precision
    if name == "auto":
        name = "bf16" if native_bf16 else "fp32"
    soft = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}
    compute = jnp.float32 if name == "fp32" else jnp.bfloat16
    params = jnp.bfloat16 if name == "bf16-pure" else jnp.float32
    return Precision(name, params, compute, soft[cfg.model.softmax_dtype])


class Linear(nn.Module):
    """y = x W^T + b with W stored [out, in], as torch's nn.Linear."""

    n_in: int
    n_out: int
    bias: bool
    std: float
    p: Precision

    @nn.compact
    def __call__(self, x):
        init = nn.initializers.normal(self.std)
        w = self.param("weight", init, (self.n_out, self.n_in), self.p.param_dtype)
        y = x.astype(self.p.compute_dtype) @ w.astype(self.p.compute_dtype).T
        if self.bias:
            b = self.param("bias", nn.initializers.zeros, (self.n_out,), self.p.param_dtype)
            y = y + b.astype(self.p.compute_dtype)
        return y


class LayerNorm(nn.Module):
    """torch's LayerNorm: eps 1e-5, two-pass variance, statistics in fp32."""

    d: int
    bias: bool
    p: Precision

    @nn.compact
    def __call__(self, x):
        g = self.param("weight", nn.initializers.ones, (self.d,), self.p.param_dtype)
        x32 = x.astype(jnp.float32)
        mean = x32.mean(-1, keepdims=True)
        var = jnp.square(x32 - mean).mean(-1, keepdims=True)
        y = (x32 - mean) * jax.lax.rsqrt(var + 1e-5) * g.astype(jnp.float32)
        if self.bias:
            y = y + self.param("bias", nn.initializers.zeros, (self.d,), self.p.param_dtype)
        return y.astype(self.p.compute_dtype)


class Attention(nn.Module):
    m: ModelConfig
    p: Precision

    @nn.compact
    def __call__(self, x_BTD, deterministic: bool, mask_BTT=None):
        m, p = self.m, self.p
        B, T, D = x_BTD.shape
        H, K = m.n_head, D // m.n_head
        resid = m.init_std / math.sqrt(2 * m.n_layer)
        h_BTD = LayerNorm(D, m.bias, p, name="norm")(x_BTD)
        q, k, v = (
            Linear(D, D, m.bias, m.init_std, p, name=name)(h_BTD)
            .reshape(B, T, H, K)
            .transpose(0, 2, 1, 3)
            for name in "qkv"
        )
        s = p.softmax_dtype
        scores_BHTT = (q.astype(s) * K**-0.5) @ k.astype(s).swapaxes(-1, -2)
        allowed = jnp.tril(jnp.ones((T, T), dtype=bool)) if mask_BTT is None else mask_BTT[:, None]
        weights = jax.nn.softmax(jnp.where(allowed, scores_BHTT, -jnp.inf), axis=-1)
        weights = nn.Dropout(m.dropout)(weights, deterministic=deterministic)
        y = (weights.astype(p.compute_dtype) @ v).transpose(0, 2, 1, 3).reshape(B, T, D)
        y = Linear(D, D, m.bias, resid, p, name="proj")(y)
        return nn.Dropout(m.dropout)(y, deterministic=deterministic)


class MLP(nn.Module):
    m: ModelConfig
    p: Precision

    @nn.compact
    def __call__(self, x_BTD, deterministic: bool):
        m, p = self.m, self.p
        D, F = m.d_model, m.mlp_ratio * m.d_model
        h = Linear(D, F, m.bias, m.init_std, p, name="fc")(
            LayerNorm(D, m.bias, p, name="norm")(x_BTD)
        )
        h = jax.nn.gelu(h, approximate=True)
        y = Linear(F, D, m.bias, m.init_std / math.sqrt(2 * m.n_layer), p, name="proj")(h)
        return nn.Dropout(m.dropout)(y, deterministic=deterministic)


REMAT_POLICIES = {
    "selective": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
    "dots": jax.checkpoint_policies.dots_saveable,
}
"""memory.checkpointing 'selective' on JAX: keep the weight matmuls' outputs, recompute the
rest, attention's batched matmuls included (the policy of "NanoGPT with JAX, part 2"); 'dots'
keeps every matmul's output, the attention scores and their product with V too."""


def _remat(cls, policy=None, prevent_cse: bool = True, static_argnums=(2,)):
    # a Block's static argnum 2 is `deterministic` (0 is the module; a ScanBlock holds it as
    # an attribute: none); inside a scan, CSE cannot defeat the rematerialisation and
    # preventing it only costs (prevent_cse=False, Lippe's tutorial)
    return nn.remat(cls, prevent_cse=prevent_cse, policy=policy, static_argnums=static_argnums)


class Block(nn.Module):
    m: ModelConfig
    p: Precision
    remat_parts: tuple[str, ...] = ()

    @nn.compact
    def __call__(self, x_BTD, deterministic: bool, mask_BTT=None):
        attn = _remat(Attention) if "attn" in self.remat_parts else Attention
        mlp = _remat(MLP) if "mlp" in self.remat_parts else MLP
        x_BTD = x_BTD + attn(self.m, self.p, name="attn")(x_BTD, deterministic, mask_BTT)
        return x_BTD + mlp(self.m, self.p, name="mlp")(x_BTD, deterministic)


class ScanBlock(nn.Module):
    """A Block as nn.scan wants it: (carry, x) -> (carry, y); x is the packed rows' mask
    (or None), the same for every layer (broadcast)."""

    m: ModelConfig
    p: Precision
    remat_parts: tuple[str, ...] = ()
    deterministic: bool = True

    @nn.compact
    def __call__(self, x_BTD, mask_BTT):
        return Block(self.m, self.p, self.remat_parts, name="block")(
            x_BTD, self.deterministic, mask_BTT
        ), None


def block_class(kind: str, index: int, every: int):
    """The (maybe rematerialised) block of layer `index` and the parts rematerialised inside."""
    if kind in ("attn", "mlp"):
        return Block, (kind,)
    if kind == "attn+mlp":
        return Block, ("attn", "mlp")
    if kind == "block" or (kind == "every" and index % every == 0):
        return _remat(Block), ()
    if kind in REMAT_POLICIES:
        return _remat(Block, REMAT_POLICIES[kind]), ()
    return Block, ()


def scan_block_class(kind: str):
    """The scanned block: every layer the same (memory.checkpointing every:K is refused)."""
    if kind == "block" or kind in REMAT_POLICIES:
        policy = REMAT_POLICIES.get(kind)
        return _remat(ScanBlock, policy, prevent_cse=False, static_argnums=()), ()
    return ScanBlock, {"attn": ("attn",), "mlp": ("mlp",), "attn+mlp": ("attn", "mlp")}.get(
        kind, ()
    )


class GPT(nn.Module):
    """Logits over the padded vocabulary (padding masked to -inf); with `logits` False, the
    final hidden states (for the chunked loss, which applies the output layer itself).
    `positions_BT`: rows of packed documents, each attending only within itself (the torch
    model's rule, models/documents.py)."""

    m: ModelConfig
    p: Precision
    checkpointing: str = "none"
    scan: bool = False
    logits: bool = True

    @nn.compact
    def __call__(self, idx_BT, deterministic: bool = True, positions_BT=None):
        m, p = self.m, self.p
        V, D, T = padded_vocab(m), m.d_model, idx_BT.shape[1]
        init = nn.initializers.normal(m.init_std)
        wte = self.param("wte", init, (V, D), p.param_dtype)
        wpe = self.param("wpe", init, (m.seq_len, D), p.param_dtype)
        pos = wpe[:T] if positions_BT is None else wpe[positions_BT]
        mask = None if positions_BT is None else document_mask(positions_BT)
        x = (wte[idx_BT] + pos).astype(p.compute_dtype)
        x = nn.Dropout(m.dropout)(x, deterministic=deterministic)
        ck = parse_checkpointing(self.checkpointing)
        if self.scan:
            cls, parts = scan_block_class(ck.kind)
            scanned = nn.scan(
                cls,
                variable_axes={"params": 0},
                split_rngs={"params": True, "dropout": True},
                in_axes=nn.broadcast,
                length=m.n_layer,
            )
            x, _ = scanned(m, p, parts, deterministic, name="blocks")(x, mask)
        else:
            for i in range(m.n_layer):
                cls, parts = block_class(ck.kind, i, ck.every)
                x = cls(m, p, parts, name=f"blocks_{i}")(x, deterministic, mask)
        h = LayerNorm(D, m.bias, p, name="norm_f")(x)
        if not self.logits:
            return h
        if m.tie_embeddings:
            logits = h @ wte.astype(p.compute_dtype).T
        else:
            logits = Linear(D, V, m.bias, m.init_std, p, name="lm_head")(h)
        logits = logits.astype(jnp.float32)
        if m.vocab_size < V:
            logits = logits.at[..., m.vocab_size :].set(-jnp.inf)
        return logits


def document_mask(positions_BT):
    """[B, T, T]: query i attends to key j <= i of its own document (a document starts where
    a position is not its predecessor's plus one, as models/documents.py reads them)."""
    first = positions_BT[:, :1] - 1
    docs = jnp.cumsum(jnp.diff(positions_BT, prepend=first, axis=-1) != 1, axis=-1)
    T = positions_BT.shape[-1]
    causal = jnp.tril(jnp.ones((T, T), dtype=bool))
    return (docs[:, :, None] == docs[:, None, :]) & causal
