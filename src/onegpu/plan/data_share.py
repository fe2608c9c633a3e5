"""What a planned step trains of the configured data: rows of instruction or chat examples pad
and mask (prompts, padding), so a step of B x T tokens trains fewer. The plan reads the same
token cache and rows a run would (tokenizing once; the run then finds them cached)."""

from __future__ import annotations

from typing import Any

import numpy as np

from onegpu.config import Config
from onegpu.data.windows import IGNORE_INDEX

SAMPLED_ROWS = 1024
"""Rows read to average the trained targets of a row (evenly spread over the split)."""


def data_share(cfg: Config, predicted_tokens_per_s: float | None) -> dict[str, Any]:
    """The plan's `data` section: packing, padding share, tokens and trained tokens a step,
    and the predicted trained tokens/s; empty for data without examples (stdlib,
    synthetic tokens, .bin token files)."""
    d = cfg.data
    if d.source in ("stdlib", "synthetic") or d.source.endswith(".bin"):
        return {}
    from onegpu.backends.torch.data import prepare_data
    from onegpu.distributed import single_process

    splits = prepare_data(cfg, single_process())
    rows = splits.train_rows
    picked = np.unique(np.linspace(0, len(rows) - 1, min(len(rows), SAMPLED_ROWS)).astype(int))
    trained = np.mean([np.count_nonzero(rows.row(int(i))[1] != IGNORE_INDEX) for i in picked])
    step_tokens = cfg.train.batch_size * cfg.train_seq_len
    share = float(trained) / cfg.train_seq_len
    section = {
        "packing": splits.packing,
        "padding": rows.stats.get("padding", 0.0),
        "tokens_per_step": step_tokens,
        "trained_tokens_per_step": share * step_tokens,
    }
    if predicted_tokens_per_s:
        section["predicted_trained_tokens_per_s"] = share * predicted_tokens_per_s
    return {"data": section}


def data_lines(r: dict[str, Any]) -> list[str]:
    """The plan's line on the data ([] without a data section)."""
    if "data" not in r:
        return []
    d = r["data"]
    rows = {"none": "one example a row", "stream": "windows of the stream"}.get(
        d["packing"], f"{d['packing']}-packed rows"
    )
    line = (
        f"  data: {rows}, {d['padding']:.0%} padding: "
        f"{d['trained_tokens_per_step']:,.0f} of {d['tokens_per_step']:,} tokens a step trained"
    )
    if "predicted_trained_tokens_per_s" in d:
        line += f", {d['predicted_trained_tokens_per_s']:,.0f} trained tokens/s predicted"
    return [line]
