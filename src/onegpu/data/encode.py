"""Examples become token sequences with a loss mask.

Plain text keeps its layout: the end-of-text token, then the text's tokens, every one trained
(the separator GPT-2 puts between documents). An instruction or chat example is its tokens then
the end-of-text token (unless the template already ended with it), and a token is trained when
any character it covers lies in a trained span: a token that straddles the prompt's end and the
answer's start belongs to the answer. The end-of-text token is trained when the answer ends the
example, so the model learns to stop.
"""

from __future__ import annotations

import numpy as np

from onegpu.data.examples import Example, Format
from onegpu.data.tokenizer import Tokenizer


def encode_example(tok: Tokenizer, fmt: Format, ex: Example) -> tuple[np.ndarray, np.ndarray]:
    """(ids, trained) of one example: int64 ids and a bool mask of the same length."""
    if not fmt.masks:
        ids = np.concatenate([[tok.eot_id], np.asarray(tok.encode(ex.text), dtype=np.int64)])
        return ids.astype(np.int64), np.ones(len(ids), dtype=bool)
    # a chat template writes its own special tokens (BOS included), as apply_chat_template does
    ids, spans = tok.encode_spans(ex.text, special_tokens=fmt.name != "chat")
    trained = _covers(spans, _trained_chars(len(ex.text), ex.trained))
    if len(ids) and ids[-1] == tok.eot_id:
        return ids, trained
    ids = np.concatenate([ids, [tok.eot_id]]).astype(np.int64)
    return ids, np.concatenate([trained, trained[-1:] if len(trained) else [False]])


def _trained_chars(n: int, spans: tuple[tuple[int, int], ...] | None) -> np.ndarray:
    chars = np.zeros(n, dtype=bool)
    if spans is None:
        chars[:] = True
    for start, end in spans or ():
        chars[start:end] = True
    return chars


def _covers(spans: np.ndarray, chars: np.ndarray) -> np.ndarray:
    """For each token's [start, end): whether any of its characters is trained."""
    counts = np.concatenate([[0], np.cumsum(chars, dtype=np.int64)])
    start = np.clip(spans[:, 0], 0, len(chars))
    end = np.clip(spans[:, 1], 0, len(chars))
    return counts[end] - counts[start] > 0
