"""Every option of onegpu, in one typed place: dataclasses, presets, TOML files, overrides.

Precedence is preset < TOML file < command line. Each field is documented by the string below
it (an attribute docstring); `onegpu train --help` shows those strings. Validation happens here,
before anything runs or is written, and raises `ConfigError` naming the field and a fix.
"""

from __future__ import annotations

import ast
import copy
import dataclasses
import difflib
import inspect
import math
import sys
import warnings
from dataclasses import dataclass, field, fields
from importlib import resources
from pathlib import Path
from typing import Any, Literal, get_args, get_origin, get_type_hints

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on Python 3.10 only
    import tomli as tomllib


class ConfigError(ValueError):
    """Bad user input: the CLI prints the message and exits with code 2."""

    def __init__(self, field_name: str, message: str):
        super().__init__(f"{field_name}: {message}")
        self.field_name = field_name


Precision = Literal["auto", "fp32", "tf32", "bf16", "bf16-pure", "fp16"]


@dataclass(kw_only=True, slots=True)
class ModelConfig:
    n_layer: int = 6
    """Number of transformer blocks."""
    n_head: int = 4
    """Attention heads per block; d_model must be divisible by it."""
    d_model: int = 256
    """Width of the residual stream."""
    seq_len: int = 256
    """Context length of the model: the number of learned positions."""
    vocab_size: int = 256
    """Rows of the embedding and output layers; may exceed the tokenizer's vocabulary (padding)."""
    pad_vocab_to: int = 64
    """Round the embedding and output rows up to a multiple of this (matrix units like it:
    GPT-2's 50,257 -> 50,304, as HF's single-GPU guide advises). Padded rows are never inputs and their logits are
    masked to -inf, so the model computes exactly the same function (1: no padding)."""
    mlp_ratio: int = 4
    """Hidden width of the MLP as a multiple of d_model."""
    dropout: float = 0.0
    """Dropout on embeddings, attention weights and residual branches (0 turns it off)."""
    bias: bool = True
    """Biases in linear layers and LayerNorms (GPT-2 has them)."""
    tie_embeddings: bool = True
    """Share the token embedding with the output layer (GPT-2 does)."""
    attention: Literal["auto", "sdpa", "flash", "efficient", "math", "plain"] = "auto"
    """'auto': the fastest exact one here (sdpa on GPUs; on CPUs sdpa or plain, timed once and
    cached); 'sdpa': torch scaled_dot_product_attention, which picks its fastest kernel;
    'flash', 'efficient', 'math': SDPA restricted to that kernel (an error if the device has
    none); 'plain': explicit softmax in model.softmax_dtype, the numerical reference."""
    softmax_dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    """Dtype of the attention scores and softmax in 'plain' attention (Lippe's tutorial keeps it fp32)."""
    init_std: float = 0.02
    """Standard deviation of the GPT-2 initialisation (residual projections are scaled down)."""


@dataclass(kw_only=True, slots=True)
class DataConfig:
    source: str = "stdlib"
    """'stdlib' (the running Python's standard-library sources, on every machine), or a path: a
    .txt file, a folder of text files, a .jsonl file, a nanoGPT .bin token file, or a folder
    holding train.bin (and val.bin)."""
    tokenizer: Literal["byte", "bpe"] = "byte"
    """'byte': UTF-8 bytes, vocab 256; 'bpe': byte-level BPE trained locally on the training split."""
    tokenizer_vocab: int = 0
    """Vocabulary size of a trained BPE tokenizer (0: model.vocab_size)."""
    seq_len: int = 0
    """Training sequence length (0: model.seq_len); must not exceed model.seq_len."""
    val_fraction: float = 0.05
    """Share of documents (files, JSONL records) held out for validation; tail share for one file."""
    text_field: str = "text"
    """Field of each JSONL record that holds the text."""
    bin_dtype: Literal["uint16", "uint32"] = "uint16"
    """Element type of pre-tokenized .bin files (nanoGPT writes uint16)."""
    num_workers: int = -1
    """DataLoader worker processes (-1: 0 on CPU, where they only add overhead; 2 on CUDA)."""
    cache_dir: str = ""
    """Where token files and trained tokenizers are cached (empty: $ONEGPU_CACHE or ~/.cache/onegpu)."""


@dataclass(kw_only=True, slots=True)
class TrainConfig:
    batch_size: int = 16
    """Sequences per optimizer step (the global batch)."""
    micro_batch_size: int = 16
    """Sequences per forward/backward; batch_size / micro_batch_size micro-batches are accumulated."""
    max_steps: int = 200
    """Optimizer steps to run."""
    precision: Precision = "auto"
    """'fp32', 'tf32' (CUDA Ampere+), 'bf16' (autocast, fp32 master weights), 'bf16-pure' (bf16
    weights and gradients; fp32 optimizer moments, Kahan-compensated updates), 'fp16' (autocast +
    loss scaling), or 'auto': bf16 where the device runs it natively, else fp32."""
    log_every: int = 10
    """Read metrics from the device every this many steps (the only host syncs of the loop)."""
    eval_every: int = 50
    """Evaluate on the validation split every this many steps and at the end (0: never)."""
    eval_batches: int = 8
    """Batches of train.micro_batch_size sequences per evaluation."""
    seed: int = 1337
    """Seed of weight init, data order and dropout."""
    device: str = "auto"
    """'auto' (CUDA if present, else CPU), 'cpu', 'cuda', 'cuda:N' or 'mps'."""
    compile: Literal["none", "default", "max-autotune", "regional"] = "none"
    """torch.compile: 'default' or 'max-autotune' compile the whole forward and loss;
    'regional' compiles one transformer block and reuses it for every layer, so compile time
    stays flat in depth (like JAX's scan over layers). Compile time is reported apart."""
    measure_memory: bool = True
    """Profile the second step's allocations to split peak memory into parameters, gradients,
    optimizer states, activations and the rest (summary.json 'memory'); costs one slow step."""
    resume: str = ""
    """Continue a run: 'auto' (from the newest complete checkpoint in the run folder; none there:
    start afresh) or the path of a checkpoint file. Empty: a new run."""
    max_consecutive_skips: int = 20
    """Stop the run (with a checkpoint from before the divergence) after this many updates in a
    row were skipped for non-finite loss or gradients."""


@dataclass(kw_only=True, slots=True)
class OptimConfig:
    name: Literal["adamw", "adamw8bit", "adafactor", "sgd"] = "adamw"
    """Optimizer: 'adamw' (fused where available; 8 bytes of state per parameter), 'adamw8bit'
    (torchao's block-wise 8-bit moments, ~2 bytes), 'adafactor' (factored second moment, no
    first moment), 'sgd' (momentum optim.beta1; 4 bytes)."""
    lr: float = 1e-3
    """Peak learning rate, reached after warmup."""
    weight_decay: float = 0.1
    """Decoupled weight decay, applied to matrices only (not biases, norms, embeddings)."""
    beta1: float = 0.9
    """AdamW first-moment decay (also SGD momentum)."""
    beta2: float = 0.95
    """AdamW second-moment decay."""
    eps: float = 1e-8
    """AdamW epsilon."""
    schedule: Literal["cosine", "exp", "constant"] = "cosine"
    """Learning-rate schedule after warmup: cosine to min_lr_ratio*lr, exponential decay
    by decay_rate per step (optax's warmup_exponential_decay_schedule), or constant."""
    warmup_steps: int = 20
    """Linear warmup from 0 over this many steps."""
    min_lr_ratio: float = 0.1
    """Final learning rate of the cosine schedule, as a fraction of lr."""
    decay_rate: float = 0.99
    """Per-step multiplier of the exponential schedule."""
    grad_clip: float = 1.0
    """Clip gradients to this global L2 norm (0: off)."""
    in_backward: bool = False
    """Step each parameter inside backward as soon as its gradient is ready, then free the
    gradient, so full gradients never coexist. Needs no accumulation and optim.grad_clip 0."""


@dataclass(kw_only=True, slots=True)
class MemoryConfig:
    checkpointing: str = "none"
    """Activation checkpointing: none, attn, mlp, attn+mlp, block, every:K, or selective (save
    matmul outputs, recompute element-wise ops). Gradients are unchanged, dropout included."""
    offload_activations: bool = False
    """Keep saved activations (including checkpoints) in host memory until backward needs them."""
    loss_chunk: int = 0
    """Compute output layer + cross-entropy in chunks of this many tokens so the full
    [tokens, vocab] logits never exist (0: off)."""
    gelu_bits: int = 0
    """Few-bit GELU backward (Novikov et al., "Few-Bit Backward"): save a k-bit code of GELU's input instead of the input,
    k in 1..4 (0: exact GELU)."""
    randomized_linear: float = 0.0
    """Randomized backward of block linear layers (Bershatsky et al.): save a random projection keeping
    this fraction of the rows of the input; unbiased weight gradients (0: off)."""


@dataclass(kw_only=True, slots=True)
class CheckpointConfig:
    every: int = 0
    """Save a checkpoint every this many steps (0: only at the end and on interruption)."""
    keep_last: int = 3
    """Keep the newest this many checkpoints; older ones are deleted once a newer one is
    complete."""
    keep_every: int = 0
    """Never delete checkpoints of steps that are multiples of this (0: none kept apart)."""


@dataclass(kw_only=True, slots=True)
class OutConfig:
    dir: str = ""
    """Run folder (empty: runs/<date-time>). Must be new or empty unless out.overwrite is true."""
    overwrite: bool = False
    """Allow writing into a folder that already holds a run."""
    progress: bool = True
    """Show a progress bar."""
    save_checkpoint: bool = True
    """Save checkpoints to DIR/checkpoints/ (at the end, on interruption and every
    checkpoint.every steps) and the final weights as DIR/model.safetensors."""


@dataclass(kw_only=True, slots=True)
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    memory: MemoryConfig = field(default_factory=MemoryConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    out: OutConfig = field(default_factory=OutConfig)

    @property
    def train_seq_len(self) -> int:
        return self.data.seq_len or self.model.seq_len

    @property
    def grad_accum_steps(self) -> int:
        return self.train.batch_size // self.train.micro_batch_size

    def sections(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


SECTIONS: dict[str, type] = get_type_hints(Config)
"""Section name -> its dataclass, in declaration order."""


# ---------------------------------------------------------------------------- field metadata


def field_docs(cls: type) -> dict[str, str]:
    """Attribute docstrings of a dataclass, read from its source (they are not kept at runtime)."""
    try:
        tree = ast.parse(inspect.getsource(cls))
    except (OSError, TypeError):
        return {}
    body = tree.body[0].body  # type: ignore[attr-defined]
    docs: dict[str, str] = {}
    for node, nxt in zip(body, body[1:]):
        if (
            isinstance(node, ast.AnnAssign)
            and isinstance(node.target, ast.Name)
            and isinstance(nxt, ast.Expr)
            and isinstance(nxt.value, ast.Constant)
            and isinstance(nxt.value.value, str)
        ):
            docs[node.target.id] = " ".join(nxt.value.value.split())
    return docs


def field_types(cls: type) -> dict[str, Any]:
    hints = get_type_hints(cls)
    return {f.name: hints[f.name] for f in fields(cls)}


def all_fields() -> list[tuple[str, str, Any, Any, str]]:
    """(section, name, type, default, doc) for every option, in declaration order."""
    out = []
    for section, cls in SECTIONS.items():
        docs = field_docs(cls)
        defaults = cls()
        for name, typ in field_types(cls).items():
            out.append((section, name, typ, getattr(defaults, name), docs.get(name, "")))
    return out


def type_name(typ: Any) -> str:
    if get_origin(typ) is Literal:
        return "{" + ",".join(str(a) for a in get_args(typ)) + "}"
    return getattr(typ, "__name__", str(typ))


# ---------------------------------------------------------------------------- value coercion


def _coerce(key: str, typ: Any, value: Any, from_cli: bool) -> Any:
    """Turn a TOML value, or a command-line string, into the field's type (or ConfigError)."""
    from_cli = from_cli and isinstance(value, str)
    if get_origin(typ) is Literal:
        choices = get_args(typ)
        if value not in choices:
            hint = difflib.get_close_matches(str(value), [str(c) for c in choices], n=1)
            extra = f" (did you mean {hint[0]!r}?)" if hint else ""
            raise ConfigError(
                key, f"{value!r} is not one of {', '.join(map(repr, choices))}{extra}"
            )
        return value
    if typ is bool:
        if isinstance(value, bool):
            return value
        if from_cli and value.lower() in ("true", "false"):
            return value.lower() == "true"
        raise ConfigError(key, f"expected true or false, got {value!r}")
    if typ is int:
        if isinstance(value, bool):
            raise ConfigError(key, f"expected an integer, got {value!r}")
        if isinstance(value, int):
            return value
        if from_cli:
            try:
                return int(value.replace("_", ""))
            except ValueError:
                pass
        raise ConfigError(key, f"expected an integer, got {value!r}")
    if typ is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if from_cli:
            try:
                return float(value)
            except ValueError:
                pass
        raise ConfigError(key, f"expected a number, got {value!r}")
    if typ is str:
        if isinstance(value, str):
            return value
        raise ConfigError(key, f"expected a string, got {value!r}")
    raise TypeError(f"unsupported field type {typ!r} for {key}")  # a bug in this file


def _unknown(key: str, candidates: list[str]) -> ConfigError:
    hint = difflib.get_close_matches(key, candidates, n=1, cutoff=0.6)
    fix = f"did you mean {hint[0]}?" if hint else "see `onegpu train --help` for the options"
    return ConfigError(key, f"unknown option; {fix}")


def all_keys() -> list[str]:
    return [f"{s}.{n}" for s, n, *_ in all_fields()]


def apply_values(cfg: Config, values: dict[str, Any], origin: str = "") -> Config:
    """Set `section.field` keys on cfg (in place) with type checks; returns cfg.

    Without an origin (a file or preset) the values are command-line strings, converted to
    the field's type; values from TOML must already have the right type.
    """
    for key, value in values.items():
        section, _, name = key.partition(".")
        cls = SECTIONS.get(section)
        types = field_types(cls) if cls else {}
        if name not in types:
            err = _unknown(key, all_keys())
            if origin:
                err = ConfigError(key, f"{err.args[0].split(': ', 1)[1]} (in {origin})")
            raise err
        setattr(getattr(cfg, section), name, _coerce(key, types[name], value, from_cli=not origin))
    return cfg


def flatten_toml(doc: dict[str, Any], origin: str) -> dict[str, Any]:
    flat: dict[str, Any] = {}
    for section, table in doc.items():
        if section == "preset":
            continue
        if not isinstance(table, dict):
            raise ConfigError(section, f"expected a [{section}] table in {origin}")
        for name, value in table.items():
            flat[f"{section}.{name}"] = value
    return flat


# ---------------------------------------------------------------------------- presets and files


def preset_names() -> list[str]:
    root = resources.files("onegpu") / "presets"
    return sorted(p.name.removesuffix(".toml") for p in root.iterdir() if p.name.endswith(".toml"))


def load_toml(path: Path) -> dict[str, Any]:
    try:
        raw = Path(path).read_bytes()
    except FileNotFoundError:
        raise ConfigError("--config", f"file {str(path)!r} does not exist") from None
    except IsADirectoryError:
        raise ConfigError("--config", f"{path} is a folder; give a TOML file") from None
    except OSError as e:
        raise ConfigError("--config", f"{path} cannot be read ({e.strerror})") from None
    try:
        text = raw.decode("utf-8-sig")  # a UTF-8 byte-order mark is harmless: drop it
    except UnicodeDecodeError:
        raise ConfigError("--config", f"{path} is not UTF-8 text; save it as UTF-8") from None
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise ConfigError("--config", f"{path} is not valid TOML: {e}") from None


def preset_values(name: str) -> dict[str, Any]:
    if name not in preset_names():
        hint = difflib.get_close_matches(name, preset_names(), n=1)
        extra = f"did you mean {hint[0]!r}? " if hint else ""
        raise ConfigError(
            "--preset", f"unknown preset {name!r}; {extra}choose from {', '.join(preset_names())}"
        )
    text = (resources.files("onegpu") / "presets" / f"{name}.toml").read_text()
    return flatten_toml(tomllib.loads(text), f"preset {name}")


DEFAULT_PRESET = "small"


def load_config(
    preset: str | None = None,
    file: str | Path | None = None,
    overrides: dict[str, str] | None = None,
) -> Config:
    """Resolve preset < file < overrides into a validated Config.

    The preset is the one named on the command line, else a top-level `preset = "..."` of the
    file, else `small`.
    """
    cfg = Config()
    doc = load_toml(Path(file)) if file else {}
    preset = preset or doc.get("preset") or DEFAULT_PRESET
    if preset:
        apply_values(cfg, preset_values(preset), f"preset {preset}")
    if file:
        apply_values(cfg, flatten_toml(doc, str(file)), str(file))
    if overrides:
        apply_values(cfg, overrides)
    validate(cfg)
    return cfg


# ---------------------------------------------------------------------------- validation


def _require(cond: bool, key: str, message: str) -> None:
    if not cond:
        raise ConfigError(key, message)


def validate(cfg: Config) -> None:
    """Shape and cross-field checks that need no device; device checks happen in build()."""
    m, d, t, o = cfg.model, cfg.data, cfg.train, cfg.optim
    for key, value in (
        ("model.n_layer", m.n_layer),
        ("model.n_head", m.n_head),
        ("model.d_model", m.d_model),
        ("model.seq_len", m.seq_len),
        ("model.vocab_size", m.vocab_size),
        ("model.mlp_ratio", m.mlp_ratio),
        ("train.batch_size", t.batch_size),
        ("train.micro_batch_size", t.micro_batch_size),
        ("train.log_every", t.log_every),
        ("train.max_consecutive_skips", t.max_consecutive_skips),
        ("checkpoint.keep_last", cfg.checkpoint.keep_last),
    ):
        _require(value >= 1, key, f"must be at least 1, got {value}")
    for key, value in (
        ("checkpoint.every", cfg.checkpoint.every),
        ("checkpoint.keep_every", cfg.checkpoint.keep_every),
    ):
        _require(value >= 0, key, f"must be >= 0 (0: off), got {value}")
    _require(t.max_steps >= 0, "train.max_steps", f"must be >= 0, got {t.max_steps}")
    _require(
        t.eval_every >= 0,
        "train.eval_every",
        f"must be >= 0 (0 turns evaluation off), got {t.eval_every}",
    )
    _require(t.eval_batches >= 1, "train.eval_batches", f"must be at least 1, got {t.eval_batches}")
    _require(
        m.d_model % m.n_head == 0,
        "model.d_model",
        f"{m.d_model} is not divisible by model.n_head={m.n_head}; "
        f"try d_model {m.n_head * max(1, round(m.d_model / m.n_head))} or a head count dividing {m.d_model}",
    )
    _require(
        t.batch_size % t.micro_batch_size == 0,
        "train.batch_size",
        f"{t.batch_size} is not divisible by train.micro_batch_size={t.micro_batch_size}; "
        f"use a multiple of it, e.g. {t.micro_batch_size * max(1, t.batch_size // t.micro_batch_size)}",
    )
    _require(0.0 <= m.dropout < 1.0, "model.dropout", f"must be in [0, 1), got {m.dropout}")
    _require(d.seq_len >= 0, "data.seq_len", f"must be >= 0 (0: model.seq_len), got {d.seq_len}")
    _require(
        d.seq_len <= m.seq_len,
        "data.seq_len",
        f"{d.seq_len} is longer than the model's context model.seq_len={m.seq_len}; "
        f"use data.seq_len <= {m.seq_len} or raise model.seq_len",
    )
    _require(
        0.0 <= d.val_fraction < 1.0, "data.val_fraction", f"must be in [0, 1), got {d.val_fraction}"
    )
    if d.tokenizer == "byte":
        _require(
            m.vocab_size >= 256,
            "model.vocab_size",
            f"{m.vocab_size} is smaller than the byte tokenizer's 256 symbols; use at least 256",
        )
    else:
        tv = d.tokenizer_vocab or m.vocab_size
        _require(
            tv >= 257,
            "data.tokenizer_vocab",
            f"a BPE vocabulary needs more than 256 entries, got {tv}",
        )
        _require(
            tv <= m.vocab_size,
            "data.tokenizer_vocab",
            f"{tv} exceeds model.vocab_size={m.vocab_size}; the model needs a row per token",
        )
    _require(
        m.pad_vocab_to >= 1, "model.pad_vocab_to", f"must be >= 1 (1: off), got {m.pad_vocab_to}"
    )
    _require(
        o.lr > 0 and math.isfinite(o.lr), "optim.lr", f"must be a finite number > 0, got {o.lr}"
    )
    _require(
        o.eps > 0 and math.isfinite(o.eps), "optim.eps", f"must be a finite number > 0, got {o.eps}"
    )
    _require(
        m.init_std > 0 and math.isfinite(m.init_std),
        "model.init_std",
        f"must be a finite number > 0, got {m.init_std}",
    )
    _require(0 <= t.seed < 2**63, "train.seed", f"must be in [0, 2**63), got {t.seed}")
    _require(
        d.num_workers >= -1,
        "data.num_workers",
        f"must be -1 (automatic), 0 (in the main process) or more, got {d.num_workers}",
    )
    _require(o.weight_decay >= 0, "optim.weight_decay", f"must be >= 0, got {o.weight_decay}")
    _require(o.warmup_steps >= 0, "optim.warmup_steps", f"must be >= 0, got {o.warmup_steps}")
    _require(o.grad_clip >= 0, "optim.grad_clip", f"must be >= 0 (0: off), got {o.grad_clip}")
    _require(
        0 <= o.min_lr_ratio <= 1, "optim.min_lr_ratio", f"must be in [0, 1], got {o.min_lr_ratio}"
    )
    _require(0 < o.decay_rate <= 1, "optim.decay_rate", f"must be in (0, 1], got {o.decay_rate}")
    _require(0 <= o.beta1 < 1, "optim.beta1", f"must be in [0, 1), got {o.beta1}")
    _require(0 <= o.beta2 < 1, "optim.beta2", f"must be in [0, 1), got {o.beta2}")
    _validate_memory(cfg)
    _validate_combinations(cfg)
    if 0 < t.max_steps < o.warmup_steps:  # valid, but almost certainly not what was meant
        warnings.warn(
            f"optim.warmup_steps={o.warmup_steps} is longer than the run "
            f"(train.max_steps={t.max_steps}): the learning rate never reaches optim.lr",
            stacklevel=2,
        )


def _validate_combinations(cfg: Config) -> None:
    """Technique pairs that cannot work together, refused before anything runs."""
    t, o = cfg.train, cfg.optim
    if o.in_backward:
        _require(
            t.micro_batch_size >= t.batch_size,
            "optim.in_backward",
            "steps inside every backward, so it cannot accumulate micro-batches; set "
            f"--train.micro_batch_size {t.batch_size} (= train.batch_size) or turn it off",
        )
        _require(
            o.grad_clip == 0,
            "optim.grad_clip",
            "clipping by global norm needs every gradient at once, which optim.in_backward "
            "never holds; set --optim.grad_clip 0 or turn optim.in_backward off",
        )
        _require(
            t.precision != "fp16",
            "train.precision",
            "fp16 loss scaling must check all gradients for inf before any step, which "
            "optim.in_backward cannot wait for; use bf16, bf16-pure or fp32",
        )
    _require(
        not (t.precision == "bf16-pure" and o.name == "adafactor"),
        "optim.name",
        "adafactor has no bf16-weight variant (its updates would be rounded away in bf16); "
        "with train.precision bf16-pure use adamw, adamw8bit or sgd",
    )


def _validate_memory(cfg: Config) -> None:
    mem = cfg.memory
    parse_checkpointing(mem.checkpointing)
    _require(
        mem.loss_chunk >= 0, "memory.loss_chunk", f"must be >= 0 (0: off), got {mem.loss_chunk}"
    )
    _require(
        0 <= mem.gelu_bits <= 4, "memory.gelu_bits", f"must be 0 (off) or 1..4, got {mem.gelu_bits}"
    )
    _require(
        0.0 <= mem.randomized_linear < 1.0,
        "memory.randomized_linear",
        f"must be 0 (off) or a kept fraction in (0, 1), got {mem.randomized_linear}",
    )


CHECKPOINTING_MODES = ("none", "attn", "mlp", "attn+mlp", "block", "every:K", "selective")


@dataclass(frozen=True, slots=True)
class Checkpointing:
    """`memory.checkpointing` parsed: which sub-modules recompute in backward."""

    kind: Literal["none", "attn", "mlp", "attn+mlp", "block", "every", "selective"]
    every: int = 1
    """For kind 'every': checkpoint blocks 0, K, 2K, ..."""


def parse_checkpointing(mode: str) -> Checkpointing:
    """The typed form of `memory.checkpointing` ('every:K' -> kind 'every', every=K)."""
    if mode.startswith("every:"):
        k = mode.split(":", 1)[1]
        if not k.isdigit() or int(k) < 1:
            raise ConfigError(
                "memory.checkpointing", f"{mode!r}: K must be a positive integer, e.g. every:2"
            )
        return Checkpointing(kind="every", every=int(k))
    if mode not in CHECKPOINTING_MODES or mode == "every:K":
        raise ConfigError(
            "memory.checkpointing", f"{mode!r} is not one of {', '.join(CHECKPOINTING_MODES)}"
        )
    return Checkpointing(kind=mode)  # type: ignore[arg-type]


def with_overrides(cfg: Config, values: dict[str, str]) -> Config:
    """A validated copy of cfg with `section.field` command-line strings applied (ConfigError
    if the result is not a valid configuration); cfg itself is untouched."""
    new = copy.deepcopy(cfg)
    apply_values(new, values)
    validate(new)
    return new


# ---------------------------------------------------------------------------- writing


def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    s = str(v).replace("\\", "\\\\").replace('"', '\\"')
    return f'"{s}"'


def to_toml(cfg: Config) -> str:
    lines: list[str] = []
    for section, obj in cfg.sections().items():
        lines.append(f"[{section}]")
        lines.extend(f"{f.name} = {_toml_value(getattr(obj, f.name))}" for f in fields(obj))
        lines.append("")
    return "\n".join(lines)


def to_dict(cfg: Config) -> dict[str, dict[str, Any]]:
    return {s: dataclasses.asdict(obj) for s, obj in cfg.sections().items()}


__all__ = [
    "CHECKPOINTING_MODES",
    "CheckpointConfig",
    "Checkpointing",
    "Config",
    "ConfigError",
    "DataConfig",
    "MemoryConfig",
    "ModelConfig",
    "OptimConfig",
    "OutConfig",
    "TrainConfig",
    "all_fields",
    "apply_values",
    "load_config",
    "parse_checkpointing",
    "preset_names",
    "to_toml",
    "validate",
    "with_overrides",
]
