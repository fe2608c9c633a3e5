"""Chat templates: a model folder's own (its tokenizer's `apply_chat_template`), or onegpu's
documented default for its GPT, and which characters of a rendered conversation are the
assistant's.

The assistant's characters are found by rendering the conversation turn by turn, as TRL and
torchtune do for templates without generation markers: the text before assistant turn i is the
template of the turns before it with the generation prompt, and the turn ends where the
template of the turns up to it ends. A template that rewrites earlier turns as the conversation
grows (one that drops past reasoning, say) cannot be split this way and is refused.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from onegpu.config import ConfigError

ROLES = ("system", "user", "assistant", "tool")

DEFAULT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>\\n' + message['content'] + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}"
)
"""onegpu's GPT has no template of its own: each turn is `<|role|>`, a newline, the content
and a newline; the generation prompt is `<|assistant|>` and a newline. The end-of-text token
closes each conversation (docs/data.md)."""

Render = Callable[[list[dict[str, Any]], bool], str]


@dataclass(frozen=True, slots=True)
class ChatTemplate:
    """`render(messages, add_generation_prompt)` -> text; `source` names it in messages and
    `text` (the template itself) keys the token cache."""

    render: Render
    source: str
    text: str


def default_template() -> ChatTemplate:
    return template_from_text(DEFAULT_TEMPLATE, "onegpu's default chat template")


def template_from_text(text: str, source: str) -> ChatTemplate:
    """A Jinja chat template rendered by transformers' own renderer (no tokenizer: its
    special tokens are not defined for the template)."""
    from transformers.utils.chat_template_utils import render_jinja_template

    def render(messages: list[dict[str, Any]], add_generation_prompt: bool) -> str:
        texts, _ = render_jinja_template(
            [messages], chat_template=text, add_generation_prompt=add_generation_prompt
        )
        return texts[0]

    return ChatTemplate(render, source, text)


def template_of(folder: Path) -> ChatTemplate:
    """The template a run or model folder renders chats with: its tokenizer's, a run's
    `chat_template.jinja` (what its chat data was rendered with), else onegpu's default."""
    for candidate in (folder, folder / "model"):
        found = folder_template(candidate) if candidate.is_dir() else None
        if found is not None:
            return found
    saved = folder / "chat_template.jinja"
    if saved.is_file():
        return template_from_text(saved.read_text(), f"the chat template of {folder}")
    return default_template()


def folder_template(folder: Path) -> ChatTemplate | None:
    """The chat template a model folder's tokenizer carries (None: it has none)."""
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(str(folder))
    except Exception:  # no tokenizer_config.json, or one transformers cannot read
        return None
    template = getattr(tokenizer, "chat_template", None)
    if not template:
        return None

    def render(messages: list[dict[str, Any]], add_generation_prompt: bool) -> str:
        return tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=add_generation_prompt
        )

    text = template if isinstance(template, str) else repr(sorted(template.items()))
    return ChatTemplate(render, f"the chat template of {folder}", text)


def check_messages(messages: Any, where: str, field: str) -> list[dict[str, Any]]:
    """A list of {role, content} with known roles and string contents, or one line naming
    the record and the message."""
    if not isinstance(messages, list) or not messages:
        raise ConfigError(
            "data.messages_field", f"{where}: {field!r} is not a non-empty list of messages"
        )
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("content"), str):
            raise ConfigError(
                "data.messages_field",
                f"{where}: message {i} is not an object with a string 'content'",
            )
        if m.get("role") not in ROLES:
            raise ConfigError(
                "data.messages_field",
                f"{where}: message {i} has role {m.get('role')!r}; roles are {', '.join(ROLES)}",
            )
    return [{"role": m["role"], "content": m["content"]} for m in messages]


def assistant_spans(
    template: ChatTemplate, messages: list[dict[str, Any]], where: str
) -> tuple[str, list[tuple[int, int]]]:
    """The rendered conversation and the character span of each assistant turn in it."""
    text = _render(template, messages, False, where)
    spans = []
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        before = _render(template, messages[:i], True, where)
        through = _render(template, messages[: i + 1], False, where)
        if not (through.startswith(before) and text.startswith(through)):
            raise ConfigError(
                "data.format",
                f"{where}: {template.source} does not render the conversation turn by turn "
                f"(turn {i} changes the text before it), so its answers cannot be masked; use "
                "--data.train_on prompt+response",
            )
        if len(through) > len(before):
            spans.append((len(before), len(through)))
    return text, spans


def _render(
    template: ChatTemplate, messages: list[dict[str, Any]], generation: bool, where: str
) -> str:
    try:
        return template.render(messages, generation)
    except Exception as e:  # jinja2's TemplateError, or a template's own raise_exception
        raise ConfigError(
            "data.format", f"{where}: {template.source} does not render ({_first_line(e)})"
        ) from None


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__
