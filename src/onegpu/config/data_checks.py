"""The data section's checks: before anything runs (ranges, the template, the tokenizer's
vocabulary against the model's), and once the splits are tokenized (do they hold a batch)."""

from __future__ import annotations

import string
from typing import TYPE_CHECKING

from onegpu.config.data import PACKED, DataConfig
from onegpu.config.options import ConfigError, ModelConfig

if TYPE_CHECKING:
    from onegpu.config.options import Config


def _require(cond: bool, key: str, message: str) -> None:
    if not cond:
        raise ConfigError(key, message)


def validate_data(d: DataConfig, m: ModelConfig) -> None:
    """What the data section can get wrong on its own and against the model."""
    _require(d.seq_len >= 0, "data.seq_len", f"must be >= 0 (0: model.seq_len), got {d.seq_len}")
    _require(
        d.seq_len <= m.seq_len,
        "data.seq_len",
        f"{d.seq_len} is longer than the model's context model.seq_len={m.seq_len}; "
        f"use data.seq_len <= {m.seq_len} or raise model.seq_len",
    )
    _require(
        m.attention != "flash" or d.packing not in PACKED,
        "model.attention",
        f"the flash kernel takes no attention mask, which data.packing {d.packing} needs to "
        "keep examples apart; use sdpa (the efficient kernel takes the mask) or packing none",
    )
    row = (d.seq_len or m.seq_len) + 1
    _require(
        0 <= d.max_len <= row,
        "data.max_len",
        f"must be between 0 (the row) and the row's {row} tokens (seq_len + 1), got {d.max_len}",
    )
    _require(
        0.0 <= d.val_fraction < 1.0, "data.val_fraction", f"must be in [0, 1), got {d.val_fraction}"
    )
    _require(
        _parses(d.template),
        "data.template",
        "does not parse as a template: write fields as {name} and literal braces as {{ }}",
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


def check_packing_layout(d: DataConfig, pp: int, tp: int) -> None:
    """Packed rows need every layer to take their positions: FSDP and DDP do, pipeline
    stages and tensor-parallel layers not yet."""
    _require(
        (pp == 1 and tp == 1) or d.packing not in PACKED,
        "data.packing",
        f"{d.packing} packs examples with their own positions, which pipeline stages and "
        "tensor-parallel layers do not take yet; use none with dist.pp or dist.tp (FSDP and "
        "DDP take packed rows)",
    )


def _parses(template: str) -> bool:
    try:
        list(string.Formatter().parse(template))
    except ValueError:
        return False
    return True


def check_data_sizes(cfg: Config, train_rows: int, val_rows: int) -> None:
    """The splits must hold a batch of rows (windows of seq_len, or examples) and a
    validation row when evaluation is on."""
    b = cfg.train.batch_size
    _require(
        train_rows >= b,
        "data.source",
        f"the training split makes {train_rows} rows of {cfg.train_seq_len} tokens, fewer than "
        f"one batch (train.batch_size = {b}); use more data or a smaller batch/seq_len",
    )
    _require(
        not cfg.train.eval_every or val_rows >= 1,
        "data.val_fraction",
        "the validation split makes no row of "
        f"{cfg.train_seq_len} tokens; raise data.val_fraction or turn evaluation off with "
        "--train.eval_every 0",
    )
