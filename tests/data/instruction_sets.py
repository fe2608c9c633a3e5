"""Small instruction and chat sets made here (nothing downloads), and a tiny model-folder
tokenizer with a ChatML chat template, shared by the data tests."""

from __future__ import annotations

import json
import random
from pathlib import Path

CHATML = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
"""Qwen2's ChatML layout, without its default system prompt."""


def arithmetic_rows(n: int, seed: int = 0) -> list[dict[str, str]]:
    """Prompt-response records whose answers take a few characters each."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        a, b = rng.randint(0, 999), rng.randint(0, 999)
        rows.append({"prompt": f"What is {a} plus {b}?\nAnswer: ", "response": f"{a + b}."})
    return rows


def chat_rows(n: int, seed: int = 0) -> list[dict]:
    """Conversations of a system prompt and two user/assistant exchanges."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        a, b = rng.randint(0, 99), rng.randint(0, 99)
        rows.append(
            {
                "messages": [
                    {"role": "system", "content": "You add numbers."},
                    {"role": "user", "content": f"{a} + {b}?"},
                    {"role": "assistant", "content": f"{a + b}."},
                    {"role": "user", "content": "Twice that?"},
                    {"role": "assistant", "content": f"{2 * (a + b)}."},
                ]
            }
        )
    return rows


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def chatml_tokenizer_folder(folder: Path, texts: list[str]) -> Path:
    """A model folder's tokenizer: a byte-level BPE trained on `texts` with ChatML's special
    tokens, saved by transformers with the chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    special = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=special,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>"
    )
    fast.chat_template = CHATML
    fast.save_pretrained(folder)
    return folder
