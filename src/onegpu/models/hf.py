"""Hugging Face `transformers` models as onegpu models: any causal LM (and encoder classifiers)
from a local folder, through the same build, techniques and step as our GPT.

Nothing here is written per architecture. The model is found through transformers' own generic
accessors: the decoder (`get_decoder()`), the output head (`get_output_embeddings()`) and the
repeated blocks (the `nn.ModuleList` whose modules are of a class named in `_no_split_modules`,
the unit transformers itself never splits across devices). `HFModel` gives onegpu's techniques
what they use on our GPT: `blocks`, `hidden(idx)` (final-normed hidden states), `lm_head`,
`vocab_size`, `cfg` and `init_weights()`.

Loading follows build.py's order: the architecture is built on the meta device from
`config.json` (no memory), the techniques wrap it, then it is materialised on the device,
initialised by transformers' own `_init_weights` (rotary tables included), and overwritten by
the folder's safetensors weights when there are any. No network: `local_files_only` always.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import logging
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch._subclasses.fake_tensor import is_fake

from onegpu.config import ConfigError, ModelConfig

# Configuration attributes by which a causal LM transforms its logits after the head: the
# chunked loss (which applies the head itself) would skip that transformation.
_LOGIT_TRANSFORMS = (
    "final_logit_softcapping",
    "logit_scale",
    "logits_scaling",
    "output_multiplier",
)


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
    # transformers may import torchao, which logs that its CUDA-only kernels do not load on a
    # CPU machine (and torch notes its enum registrations): noise, not our user's concern
    for name in ("torchao", "torch.utils._pytree"):
        logging.getLogger(name).setLevel(logging.ERROR)
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


def resolve_model_config(m: ModelConfig) -> ModelConfig:
    """`m` with the fields the folder fixes filled in from its config.json (what runs, and what
    config.toml records); ConfigError if model.seq_len exceeds the model's positions."""
    folder = open_hf_folder(m.hf, m.hf_head)
    c = (
        folder.config.get_text_config()
        if hasattr(folder.config, "get_text_config")
        else folder.config
    )
    d_model, n_layer = int(c.hidden_size), int(c.num_hidden_layers)
    limit = folder.max_positions
    if limit is not None and m.seq_len > limit:
        raise ConfigError(
            "model.seq_len",
            f"{m.seq_len} exceeds the model's {limit} positions (max_position_embeddings in "
            f"{folder.path}/config.json); use --model.seq_len {limit} or less",
        )
    inner = getattr(c, "intermediate_size", None) or getattr(c, "n_inner", None) or 4 * d_model
    return dataclasses.replace(
        m,
        n_layer=n_layer,
        n_head=int(c.num_attention_heads),
        d_model=d_model,
        vocab_size=int(c.vocab_size),
        pad_vocab_to=1,  # the folder's vocabulary is the model's: nothing is padded
        mlp_ratio=max(1, round(inner / d_model)),
        tie_embeddings=bool(getattr(c, "tie_word_embeddings", False)),
        init_std=float(getattr(c, "initializer_range", m.init_std) or m.init_std),
    )


def default_attention(m: ModelConfig) -> str:
    """What `model.attention auto` means for a folder: 'sdpa' where its transformers class
    supports SDPA, else 'plain' (transformers' eager attention; e.g. Gemma-2's soft-capped
    attention scores)."""
    folder = open_hf_folder(m.hf, m.hf_head)
    transformers = require_transformers()
    auto = (
        transformers.AutoModelForSequenceClassification
        if folder.head == "sequence-classification"
        else transformers.AutoModelForCausalLM
    )
    try:
        cls = auto._model_mapping[type(folder.config)]
    except KeyError:
        return "sdpa"  # unknown here: from_config will say what is wrong
    return "sdpa" if getattr(cls, "_supports_sdpa", True) else "plain"


def _attn_implementation(attention: str) -> str:
    """onegpu's model.attention -> transformers' attn_implementation. The SDPA kernels are
    chosen by the step's sdpa_kernel context, as for our GPT; 'plain' is transformers'
    'eager' (explicit softmax, in fp32 for most architectures)."""
    return "eager" if attention == "plain" else "sdpa"


def find_blocks(model: nn.Module) -> nn.ModuleList:
    """The repeated transformer blocks: the ModuleList of `_no_split_modules` classes."""
    names = set(getattr(model, "_no_split_modules", None) or ())
    for module in model.modules():
        if (
            isinstance(module, nn.ModuleList)
            and len(module)
            and all(type(b).__name__ in names for b in module)
        ):
            return module
    for module in model.modules():  # no declared block class: the longest list of equal blocks
        if (
            isinstance(module, nn.ModuleList)
            and len(module)
            and len({type(b) for b in module}) == 1
        ):
            return module
    raise ConfigError(
        "model.hf",
        f"cannot find the transformer blocks of {type(model).__name__} (no ModuleList of "
        "its _no_split_modules); this architecture is not supported",
    )


class HFModel(nn.Module):
    """A transformers model seen as onegpu sees its GPT. State-dict keys are the model's own
    under `hf.` (export strips it)."""

    def __init__(self, hf: nn.Module, cfg: ModelConfig, folder: HFFolder):
        super().__init__()
        self.hf = hf
        self.cfg = cfg
        self.folder = folder
        self.head = folder.head
        self.is_classifier = folder.head == "sequence-classification"
        out = self.output_layer()
        self.vocab_size = out.out_features if self.is_classifier else cfg.vocab_size
        self.padded_vocab = self.vocab_size
        # not registered as submodules: they are parts of self.hf (no duplicate state keys)
        object.__setattr__(self, "_blocks", find_blocks(hf))

    @property
    def blocks(self) -> nn.ModuleList:
        return self._blocks

    def output_layer(self) -> nn.Module:
        if self.is_classifier:
            return _classifier_out(self.hf)
        return self.hf.get_output_embeddings()

    @property
    def lm_head(self) -> nn.Module:
        return self.output_layer()

    def hidden(self, idx_BT: torch.Tensor) -> torch.Tensor:
        """Final-normed hidden states of the decoder (the head is applied by the loss)."""
        decoder = self.hf.get_decoder()
        with _never_packed():
            return decoder(input_ids=idx_BT, use_cache=False).last_hidden_state

    def forward(self, idx_BT: torch.Tensor) -> torch.Tensor:
        """Logits: [B, T, V] for a causal LM, [B, classes] for a classifier."""
        kwargs = {} if self.is_classifier else {"use_cache": False}
        with _never_packed():
            return self.hf(input_ids=idx_BT, **kwargs).logits

    def padding_params(self) -> int:
        return 0

    def tie_weights(self) -> None:
        self.hf.tie_weights()

    @torch.no_grad()
    def init_weights(self) -> None:
        """transformers' own initialisation (it also fills rotary tables and other buffers),
        then the folder's weights if it has any."""
        for module in self.hf.modules():  # built on meta: nothing is initialised yet
            module.__dict__.pop("_is_hf_initialized", None)
        for p in self.hf.parameters():
            p.__dict__.pop("_is_hf_initialized", None)
        if hasattr(self.hf, "initialize_weights"):
            self.hf.initialize_weights()
        else:  # pragma: no cover - transformers 4.x
            self.hf.apply(self.hf._init_weights)
            _init_rotary_v4(self.hf)
        self.hf.tie_weights()
        fake = any(is_fake(p) for p in self.hf.parameters())  # a plan reads no weights
        if self.folder.weights and not fake:
            load_safetensors_into(self.hf, self.folder.weights)


@contextlib.contextmanager
def _never_packed():
    """onegpu's rows are never packed sequences with restarting positions (positions are
    0..T-1 in every row), so transformers' check for them is answered without running it. The
    check reads the position ids back (`.all()` on a tensor): a host-device sync in every
    forward on a GPU; and on the planner's fake tensors it cannot run at all, so transformers
    would take another path there (an explicit [B, 1, T, T] mask, grouped-query key/value heads
    repeated) and the plan would not be the real step's."""
    import transformers.masking_utils as masking

    original = getattr(masking, "find_packed_sequence_indices", None)
    if original is None:  # pragma: no cover - a transformers without the check
        yield
        return
    masking.find_packed_sequence_indices = _not_packed
    try:
        yield
    finally:
        masking.find_packed_sequence_indices = original


def _not_packed(position_ids: torch.Tensor) -> None:
    return None


def _classifier_out(hf: nn.Module) -> nn.Module:
    for name in ("score", "classifier", "cls"):
        out = getattr(hf, name, None)
        while out is not None and not isinstance(out, nn.Linear):
            out = getattr(out, "out_proj", None) or getattr(out, "dense", None)
        if isinstance(out, nn.Linear):
            return out
    raise ConfigError("model.hf", f"cannot find the classification layer of {type(hf).__name__}")


def _init_rotary_v4(hf: nn.Module) -> None:  # pragma: no cover - transformers 4.x
    for m in hf.modules():
        if hasattr(m, "rope_init_fn") and hasattr(m, "inv_freq"):
            inv, _ = m.rope_init_fn(m.config, m.inv_freq.device)
            m.inv_freq.copy_(inv)
            if hasattr(m, "original_inv_freq"):
                m.original_inv_freq = m.inv_freq


def load_safetensors_into(model: nn.Module, files: tuple[Path, ...]) -> None:
    """Copy a folder's weights into `model` (same keys as `model.state_dict()`). Every parameter
    must be found, except those tied to one that is; anything unknown in the files is an error."""
    from safetensors import safe_open

    own = model.state_dict(keep_vars=True)
    tied = _tied_aliases(model)
    seen: set[str] = set()
    for file in files:
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for key in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                if key not in own:
                    if key.endswith(("attn.bias", "attn.masked_bias")):  # old causal-mask buffers
                        continue
                    raise ConfigError("model.hf", f"{file} holds {key!r}, which the model lacks")
                target, value = own[key], f.get_tensor(key)
                if target.shape != value.shape:
                    raise ConfigError(
                        "model.hf",
                        f"{file}: {key} has shape {tuple(value.shape)}, the config says "
                        f"{tuple(target.shape)}",
                    )
                target.data.copy_(value)
                seen.add(key)
    params = {n for n, _ in model.named_parameters(remove_duplicate=False)}
    missing = sorted(k for k in params - seen if tied.get(k) not in seen)
    if missing:
        raise ConfigError(
            "model.hf",
            f"the weights in {files[0].parent} lack {missing[0]} ({len(missing)} missing)",
        )


def _tied_aliases(model: nn.Module) -> dict[str, str]:
    """name -> another name of the same parameter object (tied weights)."""
    first: dict[int, str] = {}
    alias: dict[str, str] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) in first:
            alias[name], alias[first[id(p)]] = first[id(p)], name
        else:
            first[id(p)] = name
    return alias


def build_hf_model(cfg: ModelConfig) -> HFModel:
    """The folder's architecture, built under the caller's device context (meta for a real
    build, fake CPU for a plan), in fp32, not yet initialised."""
    folder = open_hf_folder(cfg.hf, cfg.hf_head)
    transformers = require_transformers()
    config = folder.config
    config.use_cache = False
    auto = (
        transformers.AutoModelForSequenceClassification
        if folder.head == "sequence-classification"
        else transformers.AutoModelForCausalLM
    )
    dtype_kw = "dtype" if int(transformers.__version__.split(".")[0]) >= 5 else "torch_dtype"
    try:
        hf = auto.from_config(
            config,
            attn_implementation=_attn_implementation(cfg.attention),
            **{dtype_kw: torch.float32},
        )
    except ValueError as e:
        reason = str(e).splitlines()[0]
        if "attention implementation" in reason:
            raise ConfigError(
                "model.attention",
                f"{type(config).__name__}'s transformers class has no SDPA attention; use "
                "--model.attention plain (transformers' eager attention) or auto",
            ) from None
        raise ConfigError(
            "model.hf", f"{folder.path}: {reason} (is it a {folder.head} model?)"
        ) from None
    model = HFModel(hf, cfg, folder)
    check_head(model)
    return model


def check_head(model: HFModel) -> None:
    """Refuse output layers the loss cannot use."""
    out = model.output_layer()
    if not isinstance(out, nn.Linear):
        raise ConfigError(
            "model.hf",
            f"the output layer of {type(model.hf).__name__} is a {type(out).__name__}, not a "
            "linear layer; onegpu's losses need a linear head",
        )


def logit_transform(model: HFModel) -> str | None:
    """The config attribute by which the model changes its logits after the head, if any."""
    return _config_logit_transform(model.hf.config)


def chunkable_loss(m: ModelConfig) -> bool:
    """Whether a folder's model has vocabulary-sized logits that the chunked loss computes
    exactly: a causal LM that does not change its logits after the output layer."""
    folder = open_hf_folder(m.hf, m.hf_head)
    if folder.head != "causal-lm":
        return False
    configs = {id(folder.config): folder.config}
    if hasattr(folder.config, "get_text_config"):
        text = folder.config.get_text_config()
        configs[id(text)] = text
    return not any(_config_logit_transform(c) for c in configs.values())


def _config_logit_transform(c: Any) -> str | None:
    for name in _LOGIT_TRANSFORMS:
        value = getattr(c, name, None)
        if value not in (None, 0, 1, 1.0, 0.0, False):
            return name
    return None


__all__ = [
    "HFFolder",
    "chunkable_loss",
    "HFModel",
    "build_hf_model",
    "find_blocks",
    "load_safetensors_into",
    "logit_transform",
    "open_hf_folder",
    "resolve_model_config",
]
