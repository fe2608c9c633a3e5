"""Checks that need no device, run before anything is written: ranges, shapes and
technique combinations that cannot work; each raises ConfigError naming the field and a fix."""

from __future__ import annotations

import math
import warnings

from onegpu.config.backends import validate_backend
from onegpu.config.checkpointing import parse_checkpointing
from onegpu.config.data_checks import check_packing_layout, validate_data
from onegpu.config.layout import check_layout, check_pipeline_batches, resolve_layout
from onegpu.config.options import (
    LOW_RANK_OPTIMIZERS,
    Config,
    ConfigError,
    DistConfig,
    MemoryConfig,
    TrainConfig,
)


def _require(cond: bool, key: str, message: str) -> None:
    if not cond:
        raise ConfigError(key, message)


def validate(cfg: Config) -> None:
    """Shape and cross-field checks that need no device; device checks happen in build()."""
    _validate_counts(cfg)
    _validate_shapes(cfg)
    _validate_optim(cfg)
    _validate_memory(cfg.memory)
    _validate_combinations(cfg)
    _validate_offload(cfg)
    validate_backend(cfg)
    check_layout(cfg)
    t, o = cfg.train, cfg.optim
    if 0 < t.max_steps < o.warmup_steps:  # valid, but almost certainly not what was meant
        warnings.warn(
            f"optim.warmup_steps={o.warmup_steps} is longer than the run "
            f"(train.max_steps={t.max_steps}): the learning rate never reaches optim.lr",
            stacklevel=2,
        )


def _validate_counts(cfg: Config) -> None:
    """Counts and intervals: at least 1, or >= 0 where 0 turns something off."""
    m, d, t = cfg.model, cfg.data, cfg.train
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
    _require(0 <= t.seed < 2**63, "train.seed", f"must be in [0, 2**63), got {t.seed}")
    _require(
        d.num_workers >= -1,
        "data.num_workers",
        f"must be -1 (automatic), 0 (in the main process) or more, got {d.num_workers}",
    )
    _require(
        m.pad_vocab_to >= 1, "model.pad_vocab_to", f"must be >= 1 (1: off), got {m.pad_vocab_to}"
    )


def _validate_shapes(cfg: Config) -> None:
    """Shapes that must divide or fit each other: heads, batches, sequence, vocabulary."""
    m, d, t = cfg.model, cfg.data, cfg.train
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
    _require(
        m.attention != "blocked" or m.dropout == 0,
        "model.attention",
        f"blocked attention saves its probabilities undropped and takes no dropout "
        f"(model.dropout={m.dropout}); use sdpa or set model.dropout 0",
    )
    _require(
        m.attention != "blocked" or t.precision != "fp16",
        "model.attention",
        "blocked attention runs its backward products in the compute dtype, where fp16 and "
        "GradScaler's scaled gradients could overflow; use bf16 or fp32 precision, or sdpa",
    )
    _require(
        m.attention != "blocked" or not m.hf,
        "model.attention",
        "blocked is onegpu GPT's attention; a model.hf model runs transformers' kernels: use "
        "auto, sdpa or plain",
    )
    validate_data(d, m)


def _validate_optim(cfg: Config) -> None:
    m, o = cfg.model, cfg.optim
    _require(
        o.lr > 0 and math.isfinite(o.lr), "optim.lr", f"must be a finite number > 0, got {o.lr}"
    )
    _require(
        o.eps > 0 and math.isfinite(o.eps), "optim.eps", f"must be a finite number > 0, got {o.eps}"
    )
    _require(o.base_batch >= 0, "optim.base_batch", f"must be 0 or more, got {o.base_batch}")
    _require(
        o.lr_scaling == "none" or o.base_batch > 0,
        "optim.base_batch",
        f"optim.lr_scaling {o.lr_scaling} scales optim.lr from the batch it was tuned at: give "
        "that batch (sequences), e.g. --optim.base_batch 16",
    )
    _require(
        m.init_std > 0 and math.isfinite(m.init_std),
        "model.init_std",
        f"must be a finite number > 0, got {m.init_std}",
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
    _require(o.rank >= 0, "optim.rank", f"must be >= 0 (0: the method's default), got {o.rank}")
    _require(
        o.update_proj_gap >= 1, "optim.update_proj_gap", f"must be >= 1, got {o.update_proj_gap}"
    )
    _require(
        o.proj_scale >= 0 and math.isfinite(o.proj_scale),
        "optim.proj_scale",
        f"must be a finite number >= 0 (0: the method's default), got {o.proj_scale}",
    )


def _validate_combinations(cfg: Config) -> None:
    """Technique pairs that cannot work together, refused before anything runs."""
    t, o = cfg.train, cfg.optim
    if o.in_backward:
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
    ck = parse_checkpointing(cfg.memory.checkpointing)
    _require(
        ck.kind != "budget-compiled" or t.compile in ("regional", "default", "max-autotune"),
        "memory.checkpointing",
        "budget-compiled is torch.compile's partitioner choosing what to recompute: set "
        "--train.compile regional (or default), or use budget:BYTES without compile",
    )
    _require(
        ck.kind != "budget-compiled" or cfg.model.dropout == 0,
        "memory.checkpointing",
        "budget-compiled recomputes random ops with other masks than forward drew (pytorch "
        "#190758: wrong gradients with dropout); set model.dropout 0, or use budget:BYTES",
    )
    selective = ck.kind in ("selective", "dots") or "selective" in ck.per_block
    _require(
        not (selective and t.compile in ("regional", "default", "max-autotune")),
        "memory.checkpointing",
        f"selective checkpointing is not traced by torch.compile here (dynamo: checkpoint not "
        f"implemented for its policy context), so train.compile {t.compile} cannot take it; "
        "use block or attn+mlp checkpointing with compile, or --train.compile none (or auto)",
    )
    _require(
        not (
            t.precision == "bf16-pure"
            and o.name in ("adafactor", "lamb", "lars", "adam-mini", *LOW_RANK_OPTIMIZERS)
        ),
        "optim.name",
        f"{o.name} has no bf16-weight variant (its updates would be rounded away in bf16); "
        "with train.precision bf16-pure use adamw, adamw8bit, adamw4bit or sgd",
    )


def _validate_offload(cfg: Config) -> None:
    """Where offloaded state may live, and what it cannot be combined with."""
    o = cfg.optim
    _require(
        not (cfg.memory.offload_params and cfg.dist.strategy in ("none", "ddp")),
        "memory.offload_params",
        f"streams FSDP2's host-resident shards, which dist.strategy {cfg.dist.strategy} does "
        "not have; use --dist.strategy auto (or fsdp)",
    )
    _require(
        not (cfg.memory.offload_dir and not cfg.memory.offload_optimizer),
        "memory.offload_dir",
        "holds the host optimizer's states and weight copies; add --memory.offload_optimizer "
        "true (or leave memory.offload_dir empty)",
    )
    if cfg.memory.offload_dir:
        _require(
            _writable_folder(cfg.memory.offload_dir),
            "memory.offload_dir",
            f"{cfg.memory.offload_dir} is not a folder this user can write to (nor can it be "
            "made); give a folder on a local disk with room for the optimizer's states",
        )
    _require(
        not (cfg.memory.offload_states and cfg.memory.offload_optimizer),
        "memory.offload_states",
        "keeps the states on the host and steps on the device; memory.offload_optimizer "
        "steps on the host; choose one",
    )
    _require(
        not (cfg.memory.offload_states and cfg.train.precision == "fp16"),
        "memory.offload_states",
        "steps a large parameter a slice at a time, which fp16's loss scaler does not "
        "unscale; use bf16, bf16-pure or fp32",
    )
    _require(
        not (cfg.memory.offload_states and cfg.memory.offload_params),
        "memory.offload_states",
        "the weights in host memory (memory.offload_params) are stepped on the host with "
        "their states already; drop one of the two",
    )
    _require(
        not (cfg.memory.offload_dir and o.in_backward),
        "memory.offload_dir",
        "states on the disk are stepped a file at a time after backward, which "
        "optim.in_backward does not wait for; keep the states in host memory (no offload_dir) "
        "or turn optim.in_backward off",
    )


def _validate_memory(mem: MemoryConfig) -> None:
    parse_checkpointing(mem.checkpointing)
    _require(
        mem.loss_chunk == "auto" or mem.loss_chunk >= 0,
        "memory.loss_chunk",
        f"must be >= 0 (0: off) or auto, got {mem.loss_chunk}",
    )
    _require(
        0 <= mem.gelu_bits <= 4, "memory.gelu_bits", f"must be 0 (off) or 1..4, got {mem.gelu_bits}"
    )
    _require(
        0.0 <= mem.randomized_linear < 1.0,
        "memory.randomized_linear",
        f"must be 0 (off) or a kept fraction in (0, 1), got {mem.randomized_linear}",
    )


# Optimizers whose step and sharded checkpoints are tested under torchrun (FSDP2's DTensors,
# DDP, Distributed Checkpoint); torchao's 8-bit states and Adafactor's factored ones are not yet.
DIST_OPTIMIZERS = ("adamw", "sgd")


def resolve_strategy(dist: DistConfig, world_size: int, field: str = "dist.strategy") -> str:
    """The data-parallel strategy of one of `world_size` processes: 'fsdp' (HSDP when
    replicated too), 'ddp' or 'none' (one process, or only tensor/pipeline parallelism); an
    explicit fsdp on one process stays fsdp (weights offloaded through FSDP2). A single-process
    strategy for several processes is refused, naming `field`. The one rule torchrun's
    processes and the planner's share."""
    strategy = dist.strategy
    _require(
        not (strategy == "none" and world_size > 1),
        field,
        f"{world_size} processes but dist.strategy is none; use fsdp, ddp or auto "
        "(or start one process)",
    )
    _require(world_size >= 1, "--world-size", f"must be at least 1, got {world_size}")
    layout = resolve_layout(dist, world_size)  # a mesh that does not multiply up is refused
    if world_size == 1:
        return "none" if strategy == "auto" else strategy
    return layout.data_parallel


def check_distributed(cfg: Config, strategy: str, world_size: int) -> None:
    """What the config needs to run as one of `world_size` processes under `strategy` ('none':
    a single process); ConfigError naming the field otherwise. Called by the build and by the
    planner, so a plan refuses what training would."""
    t, d = cfg.train, cfg.dist
    _require(
        not d.cpu_offload or strategy == "fsdp",
        "dist.cpu_offload",
        "offloads FSDP's shards, so it needs dist.strategy fsdp under torchrun "
        "(`torchrun --nproc-per-node 1 -m onegpu train --dist.strategy fsdp ...` on one "
        "device); for activations use memory.offload_activations",
    )
    if strategy == "none" and world_size == 1:
        return
    for field in ("offload_optimizer", "offload_states"):
        _require(
            not getattr(cfg.memory, field),
            f"memory.{field}",
            "is for one process; under torchrun use dist.cpu_offload (FSDP2's shards on the host)",
        )
    _require(
        t.compile not in ("default", "max-autotune"),
        "train.compile",
        f"{t.compile!r} compiles the whole step, which does not trace FSDP/DDP's "
        "communication here; use 'regional' (per-block compile, as torchtitan does)",
    )
    _require(
        not cfg.optim.in_backward,
        "optim.in_backward",
        "is not supported with several processes (gradients are reduced after backward); "
        "turn it off",
    )
    _require(
        not (strategy == "fsdp" and t.precision == "fp16"),
        "train.precision",
        "fp16 loss scaling over FSDP shards is not supported; use bf16 (no loss scaling)",
    )
    _require(
        t.precision != "bf16-pure",
        "train.precision",
        "bf16-pure's Kahan-compensated optimizer states do not go through sharded "
        "checkpoints yet; use bf16 (under FSDP: bf16 compute on fp32 master shards, each "
        "process holding 1/N of them)",
    )
    _require(
        parse_checkpointing(cfg.memory.checkpointing).kind != "budget",
        "memory.checkpointing",
        "budget:BYTES plans one process; with several processes use block, selective, "
        "every:K or a per-block plan (blocks:...)",
    )
    _require(
        cfg.optim.name in DIST_OPTIMIZERS,
        "optim.name",
        f"{cfg.optim.name} is not supported with several processes yet; use "
        f"{' or '.join(DIST_OPTIMIZERS)}",
    )
    layout = resolve_layout(d, world_size)
    check_packing_layout(cfg.data, layout.pp, layout.tp)
    check_batch_split(cfg.train, layout.dp)
    check_pipeline_batches(cfg, layout)


def check_batch_split(t: TrainConfig, world_size: int) -> None:
    """The global batch must split into `world_size` data-parallel processes x whole
    micro-batches."""
    _require(world_size >= 1, "--world-size", f"must be at least 1, got {world_size}")
    _require(
        t.batch_size % (t.micro_batch_size * world_size) == 0,
        "train.batch_size",
        f"the global batch {t.batch_size} does not split into {world_size} processes x "
        f"micro-batches of {t.micro_batch_size}; use a multiple of "
        f"{t.micro_batch_size * world_size}",
    )


def _writable_folder(path: str) -> bool:
    """Whether `path` is a writable folder, or could be made as one (its nearest existing
    parent is a writable folder): checked without touching the disk."""
    import os
    from pathlib import Path

    p = Path(path).expanduser().absolute()
    while not p.exists():
        if p.parent == p:
            return False
        p = p.parent
    return p.is_dir() and os.access(p, os.W_OK | os.X_OK)
