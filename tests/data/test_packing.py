"""Rows of examples: one example a row trains exactly as the example would alone (causal
attention never reaches the padding after it), where windows of the stream let an example
attend to the one before it; over-long examples are truncated or dropped, and counted."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from instruction_sets import arithmetic_rows, write_jsonl

from onegpu.config import ConfigError, DataConfig
from onegpu.data.tokens import prepare_tokens
from onegpu.data.windows import IGNORE_INDEX, example_rows

T = 48


def _splits(tmp_path, packing: str, **over):
    rows = arithmetic_rows(12)
    source = str(write_jsonl(tmp_path / "pr.jsonl", rows))
    data = DataConfig(
        source=source, cache_dir=str(tmp_path), val_fraction=0, packing=packing, **over
    )
    return prepare_tokens(data, 256).cut(data, T)


def _gpt(tiny_cfg):
    from onegpu.models.gpt import GPT

    torch.manual_seed(0)
    model = GPT(tiny_cfg.model)
    model.init_weights()
    return model.eval()


def _llama():
    import transformers
    from conftest import make_hf_config

    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(make_hf_config("llama")).eval()


def _logits(model, x: torch.Tensor) -> torch.Tensor:
    out = model(x)
    return out.logits if hasattr(out, "logits") else out


def _loss_and_grads(model, x: torch.Tensor, y: torch.Tensor):
    model.zero_grad(set_to_none=True)
    logits = _logits(model, x)
    loss = torch.nn.functional.cross_entropy(
        logits.flatten(0, 1).float(), y.flatten(), ignore_index=IGNORE_INDEX
    )
    loss.backward()
    return loss.detach(), [p.grad.clone() for p in model.parameters() if p.grad is not None]


@pytest.mark.parametrize("arch", ["gpt", "llama"])
def test_one_example_a_row_trains_as_the_example_alone_and_the_stream_leaks(
    tmp_path, tiny_cfg, arch
):
    model = _gpt(tiny_cfg) if arch == "gpt" else _llama()
    splits = _splits(tmp_path, "none")
    rows, tokens, mask = splits.train_rows, splits.train, splits.train_mask
    for i in (1, 5):
        x, y = (torch.from_numpy(a)[None] for a in rows.pair(i))
        start, end = rows.spans[i]
        alone = torch.from_numpy(tokens[start:end].astype(np.int64))[None]
        alone_y = alone[:, 1:].clone()
        alone_y[torch.from_numpy(mask[start + 1 : end].copy())[None] == 0] = IGNORE_INDEX
        row_loss, row_grads = _loss_and_grads(model, x, y)
        own_loss, own_grads = _loss_and_grads(model, alone[:, :-1], alone_y)
        torch.testing.assert_close(row_loss, own_loss, rtol=1e-6, atol=0)
        for a, b in zip(row_grads, own_grads, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
    # windows of the stream: the second example of a window sees the first one
    x, _ = (torch.from_numpy(a)[None] for a in _splits(tmp_path, "stream").train_rows.pair(0))
    second, _ = rows.spans[1]  # example 1 starts inside window 0, after example 0
    assert 0 < second < T
    alone = torch.from_numpy(tokens[second:T].astype(np.int64))[None]
    with torch.no_grad():
        leak = _logits(model, x)[:, second:] - _logits(model, alone)
    assert leak.abs().max() > 1e-3


def test_over_long_examples_are_truncated_or_dropped_and_counted():
    tokens = np.arange(30, dtype=np.uint16)
    starts = np.array([0, 5, 25])  # lengths 5, 20, 5
    cut = example_rows(tokens, starts, 8)
    assert cut.stats["overlong"] == 1 and cut.stats["tokens_lost"] == 20 - 9
    x, y = cut.pair(1)
    assert x.tolist() == list(range(5, 13)) and y.tolist() == list(range(6, 14))
    x, y = cut.pair(0)
    assert x.tolist()[:4] == [0, 1, 2, 3] and y.tolist()[4:] == [IGNORE_INDEX] * 4
    dropped = example_rows(tokens, starts, 8, drop_overlong=True)
    assert len(dropped) == 2 and dropped.stats["dropped"] == 1
    assert dropped.stats["tokens_lost"] == 20
    assert dropped.stats["padding"] == pytest.approx(1 - 8 / 16)


def test_auto_packs_text_as_a_stream_and_examples_one_a_row(tmp_path):
    assert _splits(tmp_path, "auto").packing == "none"
    (tmp_path / "a.txt").write_text("some text\n" * 300)
    text = DataConfig(source=str(tmp_path / "a.txt"), cache_dir=str(tmp_path))
    assert prepare_tokens(text, 256).cut(text, T).packing == "stream"
    np.arange(5000, dtype=np.uint16).tofile(tmp_path / "t.bin")
    tokens = DataConfig(source=str(tmp_path / "t.bin"), packing="none")
    with pytest.raises(ConfigError, match="data.packing"):
        prepare_tokens(tokens, 8192).cut(tokens, T)
