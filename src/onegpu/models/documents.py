"""Packed rows: several documents in one row, each with positions from 0, attending only within
itself (data/windows.py makes them; `data.packing greedy|bfd`).

A row's documents are read from its positions as transformers reads them (a document starts
wherever a position is not its predecessor's plus one), so our GPT and a Hugging Face model
isolate the same documents. The model is told the positions before its forward
(`LanguageModel.use_positions`), as torchtitan sets its attention masks once per batch: the
blocks, their checkpoint wrappers and their recomputation in backward keep their signatures,
and read the same mask in the recomputation as in the forward.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn


def document_ids(positions_BT: torch.Tensor) -> torch.Tensor:
    """Which document of its row each position is in: [B, T], from 0."""
    first = positions_BT[:, :1] - 1
    return (torch.diff(positions_BT, prepend=first, dim=-1) != 1).cumsum(-1)


def document_mask(positions_BT: torch.Tensor) -> torch.Tensor:
    """[B, 1, T, T] bool, True where query i may attend to key j: j <= i in i's document (a
    block-diagonal causal mask, SDPA's boolean `attn_mask`)."""
    docs_BT = document_ids(positions_BT)
    T = positions_BT.shape[-1]
    causal_TT = torch.ones(T, T, dtype=torch.bool, device=positions_BT.device).tril()
    same_BTT = docs_BT[:, :, None] == docs_BT[:, None, :]
    return (same_BTT & causal_TT)[:, None]


def language_model(model: nn.Module) -> nn.Module:
    """The model inside a DDP wrapper (FSDP2, tensor parallelism and compile keep its class)."""
    return getattr(model, "module", model)


@contextlib.contextmanager
def documents(model: nn.Module, positions_BT: torch.Tensor | None) -> Iterator[None]:
    """Forwards and backwards inside see rows of documents with these positions (None: one
    document a row, nothing to do)."""
    if positions_BT is None:
        yield
        return
    inner = language_model(model)
    inner.use_positions(positions_BT)
    try:
        yield
    finally:
        inner.use_positions(None)
