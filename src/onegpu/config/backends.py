"""What each training backend accepts: the JAX backend runs onegpu's GPT with the techniques
that have a JAX counterpart (docs/jax.md); the rest is refused in one line before anything
runs, as is the JAX-only model.scan_layers on the torch backend."""

from __future__ import annotations

from onegpu.config.environment import world_size_from_env
from onegpu.config.options import LOW_RANK_OPTIMIZERS, Config, ConfigError, TrainConfig

JAX_ATTENTION = ("auto", "plain", "sdpa")
"""JAX attention is one kernel (scores and softmax in model.softmax_dtype): these names map
to it; SDPA's named kernels do not exist there."""


def _refuse(cond: bool, key: str, message: str) -> None:
    if cond:
        raise ConfigError(key, message)


XLA_CPU_SETTINGS = {
    "none": "",
    "onednn": "--xla_cpu_use_onednn=true",
    "ynn-dot": "--xla_cpu_experimental_ynn_fusion_type=dot",
}
"""train.xla_flags by name: XLA's defaults, its oneDNN path for dots and convolutions, and
YNNPACK's dot fusion (the CPU paths jaxlib 0.10 offers; `auto` times them)."""


def xla_flags_of(value: str) -> str:
    """The XLA_FLAGS a train.xla_flags setting other than auto stands for."""
    return XLA_CPU_SETTINGS.get(value, value)


def _check_xla_flags(value: str) -> None:
    """auto, a name of XLA_CPU_SETTINGS, or flags XLA reads ('--xla_...', space-separated)."""
    flags = value.split()
    named = value == "auto" or value in XLA_CPU_SETTINGS
    _refuse(
        not named and (not flags or any(not f.startswith("--xla_") for f in flags)),
        "train.xla_flags",
        f"{value!r} is not auto, {', '.join(XLA_CPU_SETTINGS)} or XLA flags; give flags as "
        "--train.xla_flags=--xla_cpu_use_onednn=true (space-separated, each starting --xla_)",
    )


def validate_backend(cfg: Config) -> None:
    _refuse(
        bool(cfg.model.hf and cfg.model.init_from),
        "model.init_from",
        "starts onegpu's GPT from a model.safetensors; a model.hf folder brings its own "
        "weights (its model.safetensors): leave one of them empty",
    )
    _check_xla_flags(cfg.train.xla_flags)
    if cfg.train.backend == "torch":
        _refuse(
            cfg.train.xla_flags not in ("auto", "none"),  # none: a JAX run's config.toml
            "train.xla_flags",
            "sets XLA's options for the JAX backend only; leave it auto (or none) on torch, "
            "or use --train.backend jax",
        )
        _refuse_loss_kernel(cfg)
        _refuse_gelu_kernel(cfg)
        _refuse(
            cfg.model.scan_layers,
            "model.scan_layers",
            "scans the blocks on the JAX backend only; on torch, --train.compile regional "
            "compiles one block for every layer (scan's effect on compile time), or use "
            "--train.backend jax",
        )
        return
    m, t = cfg.model, cfg.train
    none_yet = "has no JAX counterpart yet: turn it off or use --train.backend torch"
    _refuse(bool(m.hf), "model.hf", f"(a Hugging Face model) {none_yet}")
    _refuse(
        m.attention not in JAX_ATTENTION,
        "model.attention",
        f"'{m.attention}' is a torch attention kernel; on JAX use auto, sdpa or plain",
    )
    _refuse(
        t.precision in ("fp16", "tf32"),
        "train.precision",
        f"{t.precision} {none_yet} (bf16, bf16-pure and fp32 run on JAX)",
    )
    _refuse_torch_kernels(t)
    _refuse(
        t.compile not in ("auto", "none"),
        "train.compile",
        "XLA compiles every JAX step already; use auto, and --model.scan_layers true for "
        "what regional compile does on torch",
    )
    _refuse_torch_memory_techniques(cfg, none_yet)
    _refuse(
        cfg.dist.strategy in ("fsdp", "ddp") or world_size_from_env() > 1,
        "dist.strategy",
        f"(several processes) {none_yet}; the JAX backend trains on one process",
    )
    _refuse_mesh(cfg, none_yet)


def _refuse_torch_kernels(t: TrainConfig) -> None:
    """The torch backend's kernel choices set on JAX, whose XLA fuses both already."""
    _refuse(
        t.loss_kernel != "auto",
        "train.loss_kernel",
        "picks the torch backend's chunked-loss kernels; XLA fuses the JAX chunked loss "
        "already: leave it auto",
    )
    _refuse(
        t.gelu_kernel != "auto",
        "train.gelu_kernel",
        "picks the torch backend's GELU kernel; XLA fuses the JAX GELU already: leave it auto",
    )


def _refuse_gelu_kernel(cfg: Config) -> None:
    """`train.gelu_kernel compiled` where no GELU of onegpu's GPT runs."""
    _refuse(
        cfg.train.gelu_kernel == "compiled" and bool(cfg.model.hf or cfg.memory.gelu_bits),
        "train.gelu_kernel",
        "compiled runs onegpu's GPT's tanh GELU, which a Hugging Face model (its own GELU) "
        "or memory.gelu_bits (few-bit GELU) replaces: leave it auto or set eager",
    )


def _refuse_loss_kernel(cfg: Config) -> None:
    """`train.loss_kernel compiled` where no chunked loss could take it."""
    compiled = cfg.train.loss_kernel == "compiled"
    _refuse(
        compiled and cfg.memory.loss_chunk == 0,
        "train.loss_kernel",
        "compiled runs the chunked loss's kernels, and memory.loss_chunk is 0 (the plain "
        "loss): set --memory.loss_chunk auto (or a chunk size), or leave train.loss_kernel auto",
    )
    _refuse(
        compiled and cfg.model.head_bias,
        "train.loss_kernel",
        "compiled fuses a chunk's softmax without a bias, and this model's untied output layer "
        "has one (model.bias true): leave it auto or set eager, or set --model.bias false",
    )
    _refuse(
        compiled and cfg.dist.tp > 1,
        "train.loss_kernel",
        "compiled fuses a chunk's softmax over the whole vocabulary, which tensor parallelism "
        "splits (its loss all-reduces between ATen's kernels): leave it auto or set eager",
    )


def _refuse_torch_memory_techniques(cfg: Config, none_yet: str) -> None:
    """The memory techniques and optimizers only the torch backend has."""
    m, mem, o = cfg.model, cfg.memory, cfg.optim
    _refuse(mem.offload_activations, "memory.offload_activations", none_yet)
    _refuse(mem.offload_params, "memory.offload_params", none_yet)
    _refuse(mem.offload_optimizer, "memory.offload_optimizer", none_yet)
    _refuse(mem.offload_states, "memory.offload_states", none_yet)
    _refuse(mem.gelu_bits != 0, "memory.gelu_bits", f"(few-bit GELU) {none_yet}")
    _refuse(mem.randomized_linear != 0, "memory.randomized_linear", none_yet)
    _refuse(
        o.name in ("adamw8bit", "adamw4bit", "lamb", "lars", "adam-mini", *LOW_RANK_OPTIMIZERS),
        "optim.name",
        f"{o.name} {none_yet}; adamw, adafactor and sgd come from optax",
    )
    _refuse(o.in_backward, "optim.in_backward", none_yet)
    _refuse(
        mem.checkpointing.startswith(("budget", "blocks:")),
        "memory.checkpointing",
        f"a per-block plan (budget:, blocks:, budget-compiled:) {none_yet}; use none, "
        "selective, dots, block or attn+mlp",
    )
    _refuse(
        m.scan_layers and mem.checkpointing.startswith("every:"),
        "memory.checkpointing",
        "every:K rematerialises some blocks, but scanned blocks are all one: use block, "
        "attn+mlp or selective with model.scan_layers, or unroll the layers",
    )


def _refuse_mesh(cfg: Config, none_yet: str) -> None:
    """Any mesh dimension above 1 is one line, naming the first."""
    d = cfg.dist
    split = [f"dist.{k}" for k in ("dp_replicate", "tp", "pp") if getattr(d, k) > 1]
    split += ["dist.dp_shard"] if d.dp_shard > 1 else []
    _refuse(
        bool(split),
        split[0] if split else "dist",
        f"(a device mesh) {none_yet}; the JAX backend trains on one process",
    )
