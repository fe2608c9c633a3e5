"""A local Hugging Face model folder: its config.json (read by transformers' AutoConfig), its
safetensors weights and its tokenizer. No network: `local_files_only` always; a name that is
not a folder may be one of the configurations packaged with onegpu."""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

from onegpu.config import ConfigError
from onegpu.quiet import library_notes_off


@dataclass(frozen=True)
class HFFolder:
    """What a local Hugging Face model folder holds."""

    path: Path
    config: Any  # transformers.PretrainedConfig
    weights: tuple[Path, ...]  # safetensors files; empty: train from the architecture
    tokenizer: Path | None  # tokenizer.json, if present
    head: str  # "causal-lm" or "sequence-classification"

    @property
    def max_positions(self) -> int | None:
        return getattr(self.config, "max_position_embeddings", None)


def require_transformers():
    """transformers, imported quietly; ConfigError if it is not installed."""
    library_notes_off()  # transformers may import torchao (onegpu/quiet.py)
    try:
        import transformers
    except ImportError:
        raise ConfigError(
            "model.hf", "needs the transformers package; pip install 'transformers>=4.56'"
        ) from None
    transformers.logging.set_verbosity_error()  # its notes on configs are not ours to print
    transformers.logging.disable_progress_bar()
    return transformers


@functools.lru_cache(maxsize=8)
def open_hf_folder(path: str, head: str = "auto") -> HFFolder:
    """Read a local folder's config.json and find its weights and tokenizer (ConfigError, naming
    model.hf and the fix, for anything missing or unreadable)."""
    folder = Path(path).expanduser()
    if not folder.is_dir() and path in packaged_models():
        folder = Path(str(resources.files("onegpu") / "presets" / "models" / path))
    if not folder.is_dir():
        raise ConfigError(
            "model.hf",
            f"{path!r} is not a folder; give a local folder holding a Hugging Face config.json "
            f"(nothing is downloaded) or a packaged one: {', '.join(packaged_models())}",
        )
    if not (folder / "config.json").is_file():
        raise ConfigError(
            "model.hf", f"{folder} has no config.json; save one with model.config.save_pretrained()"
        )
    transformers = require_transformers()
    try:
        config = transformers.AutoConfig.from_pretrained(folder, local_files_only=True)
    except (OSError, ValueError, KeyError, TypeError) as e:
        reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ConfigError("model.hf", f"{folder}/config.json cannot be read: {reason}") from None
    _require_shape(folder, config)
    if head == "auto":
        archs = getattr(config, "architectures", None) or []
        classify = any(a.endswith("ForSequenceClassification") for a in archs)
        head = "sequence-classification" if classify else "causal-lm"
    tokenizer = folder / "tokenizer.json"
    return HFFolder(
        path=folder,
        config=config,
        weights=_weight_files(folder),
        tokenizer=tokenizer if tokenizer.is_file() else None,
        head=head,
    )


_SHAPE_KEYS = ("hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size")


def _require_shape(folder: Path, config: Any) -> None:
    """ConfigError unless config.json states the model's size itself: where a key is missing,
    transformers silently uses its class default (a Llama without hidden_size becomes a
    4096-wide model nobody asked for)."""
    try:
        raw = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError):
        return  # AutoConfig read it: a format it knows
    text = raw.get("text_config") if isinstance(raw.get("text_config"), dict) else raw
    cfg = config.get_text_config() if hasattr(config, "get_text_config") else config
    aliases = getattr(cfg, "attribute_map", {}) or {}
    for key in _SHAPE_KEYS:
        if key not in text and aliases.get(key, key) not in text:
            raise ConfigError(
                "model.hf",
                f"{folder}/config.json has no {key!r}: transformers would use its default "
                f"({getattr(cfg, key, '?')}), a model of another size; write the value in",
            )


def packaged_models() -> list[str]:
    """Model configurations shipped with onegpu (`--model.hf NAME`): architectures only."""
    root = resources.files("onegpu") / "presets" / "models"
    return sorted(p.name for p in root.iterdir() if (p / "config.json").is_file())


def _weight_files(folder: Path) -> tuple[Path, ...]:
    single = folder / "model.safetensors"
    if single.is_file():
        return (single,)
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        try:
            shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (ValueError, KeyError, TypeError):
            raise ConfigError("model.hf", f"{index} is not a safetensors index") from None
        missing = [s for s in shards if not (folder / s).is_file()]
        if missing:
            raise ConfigError("model.hf", f"{folder} lacks the weight shard {missing[0]}")
        return tuple(folder / s for s in shards)
    if any(folder.glob("pytorch_model*.bin")):
        raise ConfigError(
            "model.hf",
            f"{folder} holds pickled pytorch_model.bin weights; onegpu reads safetensors only: "
            "re-save with model.save_pretrained(folder, safe_serialization=True)",
        )
    return ()


def folder_eos_id(folder: HFFolder) -> int | None:
    """The end-of-sequence id of the folder's config (the first, where it lists several)."""
    eos = getattr(folder.config, "eos_token_id", None)
    if isinstance(eos, (list, tuple)):
        eos = eos[0] if eos else None
    return eos
