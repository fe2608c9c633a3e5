"""`onegpu generate RUN_DIR_OR_HF_FOLDER --prompt TEXT`: sample a continuation, for the eye check
every training tool has. Temperature and top-k sampling under a seed (deterministic: the same
seed gives the same text); temperature 0 is greedy. The whole context is run for every new
token (no key-value cache): simple, and fast enough for a look at a small model."""

from __future__ import annotations

import torch

from onegpu.config import ConfigError
from onegpu.data.chat import template_of
from onegpu.tools.trained import load_trained


@torch.no_grad()
def sample(
    model: torch.nn.Module,
    prompt_ids: list[int],
    *,
    max_new_tokens: int,
    temperature: float,
    top_k: int,
    seed: int,
    context: int,
    vocab_size: int,
    stop_id: int | None = None,
) -> list[int]:
    """New token ids after `prompt_ids` (the model's logits over `vocab_size` real tokens)."""
    g = torch.Generator().manual_seed(seed)
    device = next(model.parameters()).device
    ids = torch.tensor([prompt_ids], dtype=torch.long, device=device)
    new: list[int] = []
    for _ in range(max_new_tokens):
        logits = model(ids[:, -context:])[0, -1, :vocab_size].float().cpu()
        if temperature == 0:
            nxt = int(logits.argmax())
        else:
            logits = logits / temperature
            if 0 < top_k < vocab_size:
                kth = torch.topk(logits, top_k).values[-1]
                logits = logits.masked_fill(logits < kth, float("-inf"))
            nxt = int(torch.multinomial(logits.softmax(-1), 1, generator=g))
        if stop_id is not None and nxt == stop_id:
            break
        new.append(nxt)
        ids = torch.cat([ids, torch.tensor([[nxt]], device=device)], dim=1)
    return new


def generate(
    source: str,
    prompt: str,
    *,
    max_new_tokens: int = 100,
    temperature: float = 0.8,
    top_k: int = 50,
    seed: int = 0,
    chat: bool = False,
) -> str:
    """The prompt's continuation as text; `chat`: the prompt is a user's message, rendered
    with the chat template, and the text is the assistant's answer (to the end-of-text)."""
    if max_new_tokens < 1:
        raise ConfigError("--max-new-tokens", f"must be at least 1, got {max_new_tokens}")
    if temperature < 0:
        raise ConfigError("--temperature", f"must be >= 0 (0: greedy), got {temperature}")
    if top_k < 0:
        raise ConfigError("--top-k", f"must be >= 0 (0: no cut), got {top_k}")
    trained = load_trained(source)
    if trained.model.is_classifier:
        raise ConfigError("RUN_DIR", "a sequence classifier does not generate text")
    tok = trained.tokenizer
    if tok is None:
        raise ConfigError(
            "RUN_DIR", f"{source} has no tokenizer (tokenizer.json) to turn the prompt into ids"
        )
    if chat:
        rendered = template_of(trained.source).render([{"role": "user", "content": prompt}], True)
        ids = [int(i) for i in tok.encode_spans(rendered, special_tokens=False)[0]]
    else:
        ids = [int(i) for i in tok.encode(prompt)]
    if not ids:
        ids = [tok.eot_id]  # an empty prompt starts a new document
    new = sample(
        trained.model,
        ids,
        max_new_tokens=max_new_tokens,
        temperature=temperature,
        top_k=top_k,
        seed=seed,
        context=trained.cfg.model.seq_len,
        vocab_size=trained.cfg.model.vocab_size,
        stop_id=tok.eot_id if chat else None,
    )
    return tok.decode(new)
