"""The data a run trains on: tokenized once (by rank 0 under torchrun, the others reading its
cache), with the tokenizer of a model folder where it has one."""

from __future__ import annotations

from onegpu.config import Config, ModelConfig, check_data_sizes
from onegpu.data.splits import TokenSplits
from onegpu.data.tokenizer import FileTokenizer
from onegpu.data.tokens import prepare_tokens
from onegpu.distributed import DistContext
from onegpu.models.hf import folder_eos_id, open_hf_folder


def prepare_data(cfg: Config, ctx: DistContext) -> TokenSplits:
    """Token splits for the run; ConfigError when they cannot hold a batch."""
    data = ctx.main_first(
        lambda: prepare_tokens(cfg.data, cfg.model.vocab_size, data_tokenizer(cfg.model))
    )
    data.cut(cfg.data, cfg.train_seq_len)
    check_data_sizes(cfg, len(data.train_rows), len(data.val_rows))
    return data


def data_tokenizer(m: ModelConfig) -> FileTokenizer | None:
    """A model folder's own tokenizer, when it has one (else data.tokenizer's)."""
    if not m.hf:
        return None
    folder = open_hf_folder(m.hf, m.hf_head)
    if folder.tokenizer is None:
        return None
    return FileTokenizer(folder.tokenizer, folder_eos_id(folder))
