"""Records become examples: the text a model reads and which of its characters carry loss.

Three formats, chosen by `data.format` or detected from the first record's fields:
- text: the record's `data.text_field`, every token trained (pre-training, as before);
- prompt-response: a prompt (`data.prompt_field`, or `data.template` filled from the record's
  fields; alpaca-style records get Alpaca's template) followed by its answer
  (`data.response_field`), the answer trained (`data.train_on response`) or all of it;
- chat: `data.messages_field`'s list of messages rendered with the chat template
  (data/chat.py), every assistant turn trained, the last one, or all of it.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from onegpu.config import ConfigError, DataConfig
from onegpu.data.chat import ChatTemplate, assistant_spans, check_messages

ALPACA_TEMPLATE = (
    "Below is an instruction that describes a task. Write a response that appropriately "
    "completes the request.\n\n### Instruction:\n{instruction}\n\n### Response:\n"
)
ALPACA_WITH_INPUT = (
    "Below is an instruction that describes a task, paired with an input that provides further "
    "context. Write a response that appropriately completes the request.\n\n"
    "### Instruction:\n{instruction}\n\n### Input:\n{input}\n\n### Response:\n"
)
"""Alpaca's two prompts (Stanford Alpaca's train.py): with an input when the record has one."""


@dataclass(frozen=True, slots=True)
class Example:
    """`text` and the character spans of it that carry loss (None: all of it)."""

    text: str
    trained: tuple[tuple[int, int], ...] | None = None


@dataclass(frozen=True, slots=True)
class Format:
    """How this run turns a record into an Example. `key` names it in the token cache's name,
    so that two formattings of one source never share a cache."""

    name: str  # "text" | "prompt-response" | "chat"
    key: str
    to_example: Callable[[Record, str], Example]
    chat_template: str | None = None  # the template a chat renders with (Jinja)

    @property
    def masks(self) -> bool:
        return self.name != "text"


Record = dict[str, Any]


def detect_format(data: DataConfig, first: Record) -> str:
    if data.format != "auto":
        return data.format
    if data.messages_field in first:
        return "chat"
    if data.response_field in first or {"instruction", "output"} <= first.keys():
        return "prompt-response"
    return "text"


def make_format(data: DataConfig, first: Record, chat: ChatTemplate | None) -> Format:
    """The format of this run's records (`first` decides 'auto'); `chat` is the template a
    chat format renders with."""
    name = detect_format(data, first)
    train_on = _train_on(data, name)
    if name == "text":
        key = "text" if data.text_field == "text" else f"text-{_digest(data.text_field)}"
        return Format("text", key, _text(data.text_field))
    if name == "prompt-response":
        shaped = {"instruction", "output"} <= first.keys()  # alpaca's fields
        alpaca = shaped and not data.template
        response = "output" if shaped and data.response_field not in first else data.response_field
        render = _prompt_response(data, response, alpaca, train_on)
        detail = f"{data.template or data.prompt_field}|{response}|{alpaca}|{train_on}"
        return Format(name, f"pr-{_digest(detail)}", render)
    assert chat is not None
    detail = f"{data.messages_field}|{train_on}|{chat.text}"
    render = _chat(data.messages_field, chat, train_on)
    return Format(name, f"chat-{_digest(detail)}", render, chat.text)


def _train_on(data: DataConfig, name: str) -> str:
    if data.train_on == "auto":
        return {"text": "prompt+response", "prompt-response": "response"}.get(name, "assistant")
    if name == "text" and data.train_on != "prompt+response":
        raise ConfigError(
            "data.train_on",
            f"{data.train_on} needs instruction or chat records; plain text trains on every "
            "token (set --data.format prompt-response or chat, or leave train_on at auto)",
        )
    if name == "prompt-response" and data.train_on == "assistant":
        raise ConfigError(
            "data.train_on",
            "assistant masks a chat's assistant turns; prompt-response records train on "
            "response or prompt+response",
        )
    return data.train_on


def _digest(text: str) -> str:
    return hashlib.sha1(text.encode()).hexdigest()[:10]


def _field(record: Record, field: str, where: str, option: str) -> Any:
    if field not in record or record[field] is None:
        raise ConfigError(
            option, f"{where} has no field {field!r} (its fields: {', '.join(map(str, record))})"
        )
    return record[field]


def _text(field: str) -> Callable[[Record, str], Example]:
    def render(record: Record, where: str) -> Example:
        text = _field(record, field, where, "data.text_field")
        if not isinstance(text, str):
            raise ConfigError(
                "data.text_field",
                f"{where}: field {field!r} is a {type(text).__name__}, not text; set "
                "--data.text_field to the field that holds the text",
            )
        return Example(text)

    return render


def _prompt_response(
    data: DataConfig, response_field: str, alpaca: bool, train_on: str
) -> Callable[[Record, str], Example]:
    def render(record: Record, where: str) -> Example:
        prompt = _prompt(record, data, alpaca, where)
        response = _field(record, response_field, where, "data.response_field")
        if not isinstance(response, str) or not response.strip():
            raise ConfigError(
                "data.response_field",
                f"{where}: the response ({response_field!r}) is empty; remove the record or "
                "fix the field",
            )
        text = prompt + response
        trained = (0, len(text)) if train_on == "prompt+response" else (len(prompt), len(text))
        return Example(text, (trained,))

    return render


def _prompt(record: Record, data: DataConfig, alpaca: bool, where: str) -> str:
    if alpaca:
        template = ALPACA_WITH_INPUT if record.get("input") else ALPACA_TEMPLATE
    elif data.template:
        template = data.template
    else:
        prompt = _field(record, data.prompt_field, where, "data.prompt_field")
        return str(prompt)
    try:
        return template.format_map(record)
    except KeyError as e:
        raise ConfigError(
            "data.template",
            f"{where} has no field {e.args[0]!r} that the template names "
            f"(its fields: {', '.join(map(str, record))})",
        ) from None
    except (ValueError, IndexError) as e:
        raise ConfigError(
            "data.template",
            f"does not render ({e}); write fields as {{name}} and braces as {{{{ }}}}",
        ) from None


def _chat(field: str, template: ChatTemplate, train_on: str) -> Callable[[Record, str], Example]:
    def render(record: Record, where: str) -> Example:
        messages = check_messages(_field(record, field, where, "data.messages_field"), where, field)
        if not any(m["role"] == "assistant" for m in messages) and train_on != "prompt+response":
            raise ConfigError(
                "data.messages_field", f"{where}: the conversation has no assistant turn to train"
            )
        text, spans = assistant_spans(template, messages, where)
        if train_on == "prompt+response":
            return Example(text, ((0, len(text)),))
        return Example(text, tuple(spans[-1:] if train_on == "response" else spans))

    return render
