"""The data section's options: where records come from and how they become examples.
Pure data, like the rest of config/."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

PACKED = ("greedy", "bfd")
"""data.packing values that put several examples in a row, each isolated by its positions."""


@dataclass(kw_only=True, slots=True)
class DataConfig:
    source: str = "stdlib"
    """'stdlib' (the running Python's standard-library sources, on every machine), 'synthetic'
    (uniform random tokens, HF's guide's dummy data: speed and memory measurements,
    classifiers), or a path: a .txt file, a folder of text files, a .jsonl file, a .json file
    holding an array of records, a .parquet file or a folder of them, a folder written by
    `datasets`' save_to_disk, a nanoGPT .bin token file, or a folder holding train.bin (and
    val.bin)."""
    tokenizer: Literal["byte", "bpe"] = "byte"
    """'byte': UTF-8 bytes, vocab 256; 'bpe': byte-level BPE trained locally on the training split."""
    tokenizer_vocab: int = 0
    """Vocabulary size of a trained BPE tokenizer (0: model.vocab_size)."""
    seq_len: int = 0
    """Training sequence length (0: model.seq_len); must not exceed model.seq_len."""
    val_fraction: float = 0.05
    """Share of documents (files, JSONL records) held out for validation; tail share for one file."""
    text_field: str = "text"
    """Field of each record (JSONL, JSON, Parquet, datasets folder) that holds the text."""
    split: str = ""
    """The split of a `datasets` DatasetDict folder to read (empty: 'train' where it has one)."""
    format: Literal["auto", "text", "prompt-response", "chat"] = "auto"
    """How a record becomes a training example: 'text' (plain text, every token trained),
    'prompt-response' (a prompt and its answer, see data.template), 'chat' (a list of messages
    with roles, rendered with the model's chat template), or 'auto': chat when records have
    data.messages_field, prompt-response when they have data.response_field (or alpaca's
    instruction/output), else text."""
    prompt_field: str = "prompt"
    """prompt-response: the field that holds the prompt (unused when data.template is set)."""
    response_field: str = "response"
    """prompt-response: the field that holds the answer ('output' for alpaca-style records)."""
    template: str = ""
    """prompt-response: the prompt as a template of the record's fields, e.g.
    '### Instruction:\n{instruction}\n\n### Response:\n' (empty: data.prompt_field as it is;
    alpaca-style records get Alpaca's template)."""
    messages_field: str = "messages"
    """chat: the field that holds the list of {role, content} messages (roles system, user,
    assistant, tool)."""
    packing: Literal["auto", "stream", "none", "greedy", "bfd"] = "auto"
    """How examples fill the rows of seq_len tokens: 'stream' (concatenated and cut into
    windows across examples: no padding, but an example attends to the one before it),
    'none' (one example per row, padded), 'greedy' (examples in order, as many a row as fit)
    or 'bfd' (best-fit decreasing: the fewest rows), the last two with each example's
    positions from 0 and attention only within it: every example trains exactly as it would
    alone; or 'auto': stream for text, none for instruction and chat data."""
    max_len: int = 0
    """The longest example kept, in tokens (0: the row, seq_len + 1; at most that): longer
    ones are truncated or dropped (data.overlong). Packing none, greedy and bfd."""
    overlong: Literal["truncate", "drop", "error"] = "truncate"
    """An example longer than data.max_len keeps its first tokens ('truncate'), is left out
    ('drop'; either is counted in the summary's data section and on the start line), or
    stops the run before it starts, naming the example ('error')."""
    train_on: Literal["auto", "prompt+response", "response", "assistant"] = "auto"
    """Which tokens carry loss: 'prompt+response' (all), 'response' (the answer; chat: the
    last assistant turn), 'assistant' (chat: every assistant turn), or 'auto': response for
    prompt-response data, assistant for chat. Masked positions are left out of the loss and
    of the token count the step divides by."""
    bin_dtype: Literal["uint16", "uint32"] = "uint16"
    """Element type of pre-tokenized .bin files (nanoGPT writes uint16)."""
    num_workers: int = -1
    """DataLoader worker processes (-1: 0 on CPU, where they only add overhead; 2 on CUDA)."""
    cache_dir: str = ""
    """Where token files and trained tokenizers are cached (empty: $ONEGPU_CACHE or ~/.cache/onegpu)."""
