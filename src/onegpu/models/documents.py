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

from onegpu.config.data import PACKED


def document_ids(positions_BT: torch.Tensor) -> torch.Tensor:
    """Which document of its row each position is in: [B, T], from 0."""
    first = positions_BT[:, :1] - 1
    return (torch.diff(positions_BT, prepend=first, dim=-1) != 1).cumsum(-1)


def placeholder_positions(packing: str, batch: int, seq_len: int) -> torch.Tensor | None:
    """Positions in a step's shapes where rows are packed (`data.packing` greedy or bfd: two
    documents a row, so the model takes its packed path), None where rows hold one each."""
    if packing not in PACKED:
        return None
    half = seq_len // 2
    row = torch.cat([torch.arange(half), torch.arange(seq_len - half)])
    return row.repeat(batch, 1)


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


@torch.no_grad()
def isolates_documents(model: nn.Module, vocab_size: int, device: torch.device) -> bool:
    """Whether the model keeps packed documents apart: the second of two documents in a row
    gives the logits it gives alone, where the same row without positions (cross-talk)
    gives others. A transformers architecture that builds its own positions or mask and
    ignores `position_ids` fails it. Eager (compiled regions are not traced for a probe)."""
    ids_BT = (torch.arange(1, 10, device=device) * 7919 % vocab_size)[None]
    first = 5
    positions_BT = torch.cat([torch.arange(first), torch.arange(9 - first)]).to(device)[None]
    was_training = model.training
    model.eval()
    try:
        with torch.compiler.set_stance("force_eager"):
            alone = _logits(model, ids_BT[:, first:])
            with documents(model, positions_BT):
                packed = _logits(model, ids_BT)[:, first:]
            mixed = _logits(model, ids_BT)[:, first:]
    finally:
        model.train(was_training)
    leak = (packed - alone).abs().max()
    crosstalk = (mixed - alone).abs().max()
    return bool(leak <= 0.1 * crosstalk)


def _logits(model: nn.Module, ids_BT: torch.Tensor) -> torch.Tensor:
    return language_model(model)(ids_BT).float()
