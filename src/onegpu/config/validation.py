"""Checks that need no device, run before anything is written: ranges, shapes and
technique combinations that cannot work; each raises ConfigError naming the field and a fix."""

from __future__ import annotations

import math
import sys
import warnings

if sys.version_info >= (3, 11):
    pass
else:  # pragma: no cover - exercised on Python 3.10 only
    pass


from onegpu.config.options import Config, ConfigError, parse_checkpointing


def _require(cond: bool, key: str, message: str) -> None:
    if not cond:
        raise ConfigError(key, message)


def validate(cfg: Config) -> None:
    """Shape and cross-field checks that need no device; device checks happen in build()."""
    m, d, t, o = cfg.model, cfg.data, cfg.train, cfg.optim
    for key, value in (
        ("model.n_layer", m.n_layer),
        ("model.n_head", m.n_head),
        ("model.d_model", m.d_model),
        ("model.seq_len", m.seq_len),
        ("model.vocab_size", m.vocab_size),
        ("model.mlp_ratio", m.mlp_ratio),
        ("train.batch_size", t.batch_size),
        ("train.micro_batch_size", t.micro_batch_size),
        ("train.log_every", t.log_every),
        ("train.max_consecutive_skips", t.max_consecutive_skips),
        ("checkpoint.keep_last", cfg.checkpoint.keep_last),
    ):
        _require(value >= 1, key, f"must be at least 1, got {value}")
    for key, value in (
        ("checkpoint.every", cfg.checkpoint.every),
        ("checkpoint.keep_every", cfg.checkpoint.keep_every),
    ):
        _require(value >= 0, key, f"must be >= 0 (0: off), got {value}")
    _require(t.max_steps >= 0, "train.max_steps", f"must be >= 0, got {t.max_steps}")
    _require(
        t.eval_every >= 0,
        "train.eval_every",
        f"must be >= 0 (0 turns evaluation off), got {t.eval_every}",
    )
    _require(t.eval_batches >= 1, "train.eval_batches", f"must be at least 1, got {t.eval_batches}")
    _require(
        m.d_model % m.n_head == 0,
        "model.d_model",
        f"{m.d_model} is not divisible by model.n_head={m.n_head}; "
        f"try d_model {m.n_head * max(1, round(m.d_model / m.n_head))} or a head count dividing {m.d_model}",
    )
    _require(
        t.batch_size % t.micro_batch_size == 0,
        "train.batch_size",
        f"{t.batch_size} is not divisible by train.micro_batch_size={t.micro_batch_size}; "
        f"use a multiple of it, e.g. {t.micro_batch_size * max(1, t.batch_size // t.micro_batch_size)}",
    )
    _require(0.0 <= m.dropout < 1.0, "model.dropout", f"must be in [0, 1), got {m.dropout}")
    _require(d.seq_len >= 0, "data.seq_len", f"must be >= 0 (0: model.seq_len), got {d.seq_len}")
    _require(
        d.seq_len <= m.seq_len,
        "data.seq_len",
        f"{d.seq_len} is longer than the model's context model.seq_len={m.seq_len}; "
        f"use data.seq_len <= {m.seq_len} or raise model.seq_len",
    )
    _require(
        0.0 <= d.val_fraction < 1.0, "data.val_fraction", f"must be in [0, 1), got {d.val_fraction}"
    )
    if m.hf:  # the vocabulary is the folder's: checked when the build reads it
        pass
    elif d.tokenizer == "byte":
        _require(
            m.vocab_size >= 256,
            "model.vocab_size",
            f"{m.vocab_size} is smaller than the byte tokenizer's 256 symbols; use at least 256",
        )
    else:
        tv = d.tokenizer_vocab or m.vocab_size
        _require(
            tv >= 257,
            "data.tokenizer_vocab",
            f"a BPE vocabulary needs more than 256 entries, got {tv}",
        )
        _require(
            tv <= m.vocab_size,
            "data.tokenizer_vocab",
            f"{tv} exceeds model.vocab_size={m.vocab_size}; the model needs a row per token",
        )
    _require(
        m.pad_vocab_to >= 1, "model.pad_vocab_to", f"must be >= 1 (1: off), got {m.pad_vocab_to}"
    )
    _require(
        o.lr > 0 and math.isfinite(o.lr), "optim.lr", f"must be a finite number > 0, got {o.lr}"
    )
    _require(
        o.eps > 0 and math.isfinite(o.eps), "optim.eps", f"must be a finite number > 0, got {o.eps}"
    )
    _require(
        m.init_std > 0 and math.isfinite(m.init_std),
        "model.init_std",
        f"must be a finite number > 0, got {m.init_std}",
    )
    _require(0 <= t.seed < 2**63, "train.seed", f"must be in [0, 2**63), got {t.seed}")
    _require(
        d.num_workers >= -1,
        "data.num_workers",
        f"must be -1 (automatic), 0 (in the main process) or more, got {d.num_workers}",
    )
    _require(o.weight_decay >= 0, "optim.weight_decay", f"must be >= 0, got {o.weight_decay}")
    _require(o.warmup_steps >= 0, "optim.warmup_steps", f"must be >= 0, got {o.warmup_steps}")
    _require(o.grad_clip >= 0, "optim.grad_clip", f"must be >= 0 (0: off), got {o.grad_clip}")
    _require(
        0 <= o.min_lr_ratio <= 1, "optim.min_lr_ratio", f"must be in [0, 1], got {o.min_lr_ratio}"
    )
    _require(0 < o.decay_rate <= 1, "optim.decay_rate", f"must be in (0, 1], got {o.decay_rate}")
    _require(0 <= o.beta1 < 1, "optim.beta1", f"must be in [0, 1), got {o.beta1}")
    _require(0 <= o.beta2 < 1, "optim.beta2", f"must be in [0, 1), got {o.beta2}")
    _validate_memory(cfg)
    _validate_combinations(cfg)
    if 0 < t.max_steps < o.warmup_steps:  # valid, but almost certainly not what was meant
        warnings.warn(
            f"optim.warmup_steps={o.warmup_steps} is longer than the run "
            f"(train.max_steps={t.max_steps}): the learning rate never reaches optim.lr",
            stacklevel=2,
        )


def _validate_combinations(cfg: Config) -> None:
    """Technique pairs that cannot work together, refused before anything runs."""
    t, o = cfg.train, cfg.optim
    if o.in_backward:
        _require(
            t.micro_batch_size >= t.batch_size,
            "optim.in_backward",
            "steps inside every backward, so it cannot accumulate micro-batches; set "
            f"--train.micro_batch_size {t.batch_size} (= train.batch_size) or turn it off",
        )
        _require(
            o.grad_clip == 0,
            "optim.grad_clip",
            "clipping by global norm needs every gradient at once, which optim.in_backward "
            "never holds; set --optim.grad_clip 0 or turn optim.in_backward off",
        )
        _require(
            t.precision != "fp16",
            "train.precision",
            "fp16 loss scaling must check all gradients for inf before any step, which "
            "optim.in_backward cannot wait for; use bf16, bf16-pure or fp32",
        )
    _require(
        not (cfg.memory.checkpointing == "selective" and t.compile == "regional"),
        "memory.checkpointing",
        "selective checkpointing inside per-block compile is not traced by torch.compile "
        "here (its policy context); use block or attn+mlp checkpointing with regional "
        "compile, or --train.compile none",
    )
    _require(
        not (t.precision == "bf16-pure" and o.name == "adafactor"),
        "optim.name",
        "adafactor has no bf16-weight variant (its updates would be rounded away in bf16); "
        "with train.precision bf16-pure use adamw, adamw8bit or sgd",
    )


def _validate_memory(cfg: Config) -> None:
    mem = cfg.memory
    parse_checkpointing(mem.checkpointing)
    _require(
        mem.loss_chunk == "auto" or mem.loss_chunk >= 0,
        "memory.loss_chunk",
        f"must be >= 0 (0: off) or auto, got {mem.loss_chunk}",
    )
    _require(
        0 <= mem.gelu_bits <= 4, "memory.gelu_bits", f"must be 0 (off) or 1..4, got {mem.gelu_bits}"
    )
    _require(
        0.0 <= mem.randomized_linear < 1.0,
        "memory.randomized_linear",
        f"must be 0 (off) or a kept fraction in (0, 1), got {mem.randomized_linear}",
    )
