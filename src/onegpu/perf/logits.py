"""The output layer's logits, from shapes alone, and the rule `memory.loss_chunk auto` follows
on both backends: whether the plain loss's [tokens, vocab] tensors are worth chunking, and
which timed chunk size to take. Torch-free (the JAX backend reads it too)."""

from __future__ import annotations

import dataclasses
from typing import Any

from onegpu.cache import has
from onegpu.config import ModelConfig
from onegpu.perf.attention_blocks import saved_prob_bytes

CHUNK_SIZES = (1024, 2048, 4096, 8192)
"""Chunk sizes `auto` times (tokens; at most the micro-batch's tokens)."""
MIN_LOGITS_SHARE = 0.25
"""`auto` chunks only where the plain loss's logits are at least this share of the activations."""
MIN_LOGITS_BYTES = 64 * 2**20
"""...and at least this large: below it, chunking cannot change what fits."""
SPEED_MARGIN = 1.05
"""Then the smallest chunk size (the least memory) whose output layer + loss runs within 5% of
the fastest contestant, plain included; plain if none does."""
UNTIMED_CHUNK = 4096
"""The chunk size of a plan for a device that is not here (nothing can be timed), where the
micro-batch has more tokens (untimed_chunk)."""


def untimed_chunk(tokens: int) -> int:
    """The chunk size a plan takes where no run timed one: UNTIMED_CHUNK, or the largest size
    `auto` would time below the micro-batch's tokens (a chunk of all of them is no contestant,
    so no run takes it); 0 (plain) where none is below."""
    return max((c for c in CHUNK_SIZES if c <= UNTIMED_CHUNK and c < tokens), default=0)


def padded_vocab(m: ModelConfig) -> int:
    """The vocabulary rounded up to model.pad_vocab_to (the padding rows' logits are -inf)."""
    return m.padded_vocab


def vocab_shard(m: ModelConfig, tp: int) -> ModelConfig:
    """The output layer one of `tp` tensor-parallel processes holds: 1/tp of the padded
    vocabulary (what `auto` weighs and times under tensor parallelism)."""
    if tp == 1:
        return m
    return dataclasses.replace(m, vocab_size=m.padded_vocab // tp, pad_vocab_to=1)


def plain_logits_bytes(m: ModelConfig, tokens: int, compute_bytes: int) -> int:
    """The plain loss's [tokens, vocab] tensors: the logits in the compute dtype, their fp32
    log-softmax (saved for backward) and, in backward, their fp32 gradient."""
    return tokens * padded_vocab(m) * (compute_bytes + 8)


def logits_share(m: ModelConfig, tokens: int, compute_bytes: int) -> float:
    """The plain loss's [tokens, vocab] tensors as a share of a micro-batch's activations.

    An estimate, from shapes: (b + 8) bytes per logit (plain_logits_bytes). A block saves about
    (7.5 + 2.5 * mlp_ratio) * d_model values per token (Korthikanti et al., "Reducing Activation
    Recomputation in Large Transformer Models": 34 bytes * d in 16-bit for mlp_ratio 4), plus
    2.5 * heads * seq values per token for attention that keeps its score matrix (plain
    attention).
    """
    head = plain_logits_bytes(m, tokens, compute_bytes)
    blocks = saved_block_bytes(m, tokens, compute_bytes)
    return head / (head + blocks)


def block_values_per_token(m: ModelConfig) -> float:
    """Values a block saves per token besides an attention score matrix (logits_share)."""
    return (7.5 + 2.5 * m.mlp_ratio) * m.d_model


def saved_block_bytes(m: ModelConfig, tokens: int, compute_bytes: int) -> float:
    """What the blocks save for backward over `tokens` tokens, estimated from the shapes as
    logits_share says; blocked attention adds its 16-bit probabilities (the keys each query
    sees)."""
    per_token = block_values_per_token(m)
    if m.attention == "plain":
        per_token += 2.5 * m.n_head * m.seq_len
    elif m.attention == "blocked":
        per_token += saved_prob_bytes(1, m.n_head, m.seq_len, 1) / m.seq_len
    return m.n_layer * tokens * per_token * compute_bytes


def worth_chunking(m: ModelConfig, tokens: int, compute_bytes: int) -> bool:
    """Whether `auto` considers chunking at all: the logits large, absolutely and as a share."""
    return (
        plain_logits_bytes(m, tokens, compute_bytes) >= MIN_LOGITS_BYTES
        and logits_share(m, tokens, compute_bytes) >= MIN_LOGITS_SHARE
    )


def leanest_within_margin(seconds: dict[str, float]) -> int:
    """The rule of `auto`: the smallest chunk size within SPEED_MARGIN of the fastest contestant
    (plain included), else 0 (plain). Applied to cached timings too, so a rule change needs no
    new timing."""
    fastest = min(seconds.values())
    within = sorted(int(c) for c, s in seconds.items() if int(c) and s <= SPEED_MARGIN * fastest)
    return within[0] if within else 0


def valid_timings(value: Any) -> bool:
    """A cached timing: the choice and every contestant's seconds, as numbers."""
    seconds = value.get("seconds") if has("chunk")(value) else None
    return (
        isinstance(seconds, dict)
        and "0" in seconds
        and all(isinstance(v, (int, float)) and k.isdigit() for k, v in seconds.items())
    )


def chosen_chunk(found: dict[str, Any], tokens: int) -> int:
    """The rule applied to a cached timing (an older entry may hold a chunk of the whole
    micro-batch, no longer a contestant)."""
    seconds = {c: s for c, s in found["seconds"].items() if int(c) < tokens}
    return leanest_within_margin(seconds)
