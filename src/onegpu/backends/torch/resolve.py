"""What actually runs, decided once: the device, then every `auto` (precision, attention, loss
chunk and its kernels), each decided by its own technique module. `train.compile auto` is decided later, in
`build.model.apply_techniques`, because it times the materialised model."""

from __future__ import annotations

import dataclasses
import warnings
from dataclasses import dataclass
from typing import Any

import torch

from onegpu.config import Checkpointing, Config, ConfigError, ModelConfig, parse_checkpointing
from onegpu.config.data import PACKED
from onegpu.config.loading import with_overrides
from onegpu.distributed import DistContext
from onegpu.distributed.parallelize import fsdp_mixed_precision
from onegpu.models.hf import chunkable_loss, default_attention, hf_head_bias, resolve_model_config
from onegpu.perf.logits import vocab_shard
from onegpu.techniques import compile_auto
from onegpu.techniques.attention import (
    BY_SAVED_BYTES,
    AttentionCall,
    attention_choice,
    check_sdpa_recompute,
    sdpa_recompute_fails,
)
from onegpu.techniques.chunked_loss import resolve_loss_chunk
from onegpu.techniques.gelu_kernel import GeluShape, resolve_gelu_kernel
from onegpu.techniques.kernel_trial import MIN_MICRO_BATCHES
from onegpu.techniques.loss_kernel_auto import LossShape, resolve_loss_kernel
from onegpu.techniques.precision import (
    DeviceCaps,
    PrecisionPolicy,
    device_caps,
    precision_weighed,
    resolve_precision,
    with_bf16_speedup,
)


@dataclass(frozen=True, slots=True)
class Resolved:
    """What actually runs, decided once. `config` is the user's config with every `auto`
    filled in (the run folder's config.toml); the user's own object is never changed."""

    device: torch.device
    precision: PrecisionPolicy
    attention: str
    checkpointing: Checkpointing
    config: Config
    loss_kernel_timing: dict[str, Any] | None = None
    """The eager-vs-compiled timing `train.loss_kernel auto` decided from (None: not timed)."""
    attention_timing: dict[str, Any] | None = None
    """The kernels' timing `model.attention auto` picked from (None: not timed)."""
    gelu_kernel_timing: dict[str, Any] | None = None
    """The timing (or why none) `train.gelu_kernel auto` decided from (None: not auto)."""
    precision_auto: dict[str, float] | None = None
    """What `train.precision auto` weighed on a CPU with native bf16: its bf16 matmuls' speed
    over fp32's and the margin (None: nothing weighed)."""
    attention_if_eager: str | None = None
    """`model.attention auto` picked from compiled timings for a run that may compile
    (`train.compile auto`): the leaner kernel eager timings pick, for a run that then stays
    eager (None: the same kernel, or one that keeps more than the plan followed)."""


def resolve_device(name: str, local_rank: int | None = None) -> torch.device:
    """`train.device` as a device; under torchrun (`local_rank` given), 'auto' and 'cuda' mean
    this process's GPU, cuda:LOCAL_RANK. The one place a device name becomes a device."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda" and local_rank is not None:
        name = f"cuda:{local_rank}"
    try:
        device = torch.device(name)
    except RuntimeError:
        raise ConfigError(
            "train.device", f"{name!r} is not a device; use auto, cpu, cuda, cuda:N or mps"
        ) from None
    _check_available(device, name)
    return device


def _check_available(device: torch.device, name: str) -> None:
    if device.type not in ("cpu", "cuda", "mps"):
        raise ConfigError("train.device", f"unsupported device type {device.type!r}")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(
            "train.device", "CUDA was asked for but no CUDA GPU is visible; use --train.device cpu"
        )
    visible = torch.cuda.device_count() if device.type == "cuda" else 0
    if device.type == "cuda" and device.index is not None and device.index >= visible:
        raise ConfigError("train.device", f"{name}: only {visible} CUDA device(s) visible")
    if device.type == "mps" and not torch.backends.mps.is_available():
        raise ConfigError(
            "train.device", "mps was asked for but is not available; use --train.device cpu"
        )


SAVES_PRODUCTS = ("selective", "dots", "budget")
"""Checkpointing modes that may keep every matmul's output (config.checkpointing)."""


def attention_call(cfg: Config, model_cfg: ModelConfig) -> AttentionCall:
    """The attention call each process makes: its micro-batch, its share of the heads under
    tensor parallelism, the training rows' length, packed documents' mask where rows hold
    several."""
    return AttentionCall(
        batch=cfg.train.micro_batch_size,
        heads=model_cfg.n_head // cfg.dist.tp,
        seq_len=cfg.train_seq_len,
        head_dim=model_cfg.d_model // model_cfg.n_head,
        documents=cfg.data.packing in PACKED,
    )


def resolve(
    cfg: Config,
    device: torch.device,
    caps: DeviceCaps | None = None,
    *,
    timed: bool = True,
    ctx: DistContext | None = None,
) -> Resolved:
    """Precision, attention and the loss chunk for `device` (whose capabilities are `caps`: read
    from the device by default, or from the GPU table when planning for a GPU that is not here).
    `timed` False (a plan): choices that time kernels take what a run here cached, if any.
    `ctx`: the run's processes (None: one), which the loss kernel's timing follows."""
    timed = timed and caps is None  # a device planned from its table: nothing here to time
    policy, precision_auto = _precision(cfg.train.precision, caps or device_caps(device))
    model_cfg = resolve_model_config(cfg.model) if cfg.model.hf else cfg.model
    attention, attention_timing, attention_if_eager = _attention(
        cfg, model_cfg, policy, device, timed=timed, ctx=ctx
    )
    model_cfg = dataclasses.replace(model_cfg, attention=attention)
    loss_chunk = resolve_loss_chunk(
        cfg.memory.loss_chunk,
        vocab_shard(model_cfg, cfg.dist.tp),  # each tensor-parallel process's columns
        cfg.train.micro_batch_size * cfg.train_seq_len,
        policy.compute_dtype,
        device,
        # a pipeline's last stage computes its loss from the logits it outputs
        chunkable=(chunkable_loss(model_cfg) if cfg.model.hf else True) and cfg.dist.pp == 1,
        timed=timed,
    )
    loss_kernel, timing = _loss_kernel(
        cfg, model_cfg, policy, loss_chunk, device, timed=timed, ctx=ctx
    )
    gelu_kernel, gelu_timing = _gelu_kernel(cfg, model_cfg, policy, device, timed=timed, ctx=ctx)
    train = dataclasses.replace(
        cfg.train, precision=policy.name, loss_kernel=loss_kernel, gelu_kernel=gelu_kernel
    )
    config = dataclasses.replace(
        cfg,
        model=model_cfg,
        train=train,
        memory=dataclasses.replace(cfg.memory, loss_chunk=loss_chunk),
    )
    return Resolved(
        device=device,
        precision=policy,
        attention=attention,
        checkpointing=parse_checkpointing(cfg.memory.checkpointing),
        config=config,
        loss_kernel_timing=timing,
        attention_timing=attention_timing,
        gelu_kernel_timing=gelu_timing,
        precision_auto=precision_auto,
        attention_if_eager=attention_if_eager,
    )


def _precision(name: str, caps: DeviceCaps) -> tuple[PrecisionPolicy, dict[str, float] | None]:
    """`train.precision`, and what `auto` weighed for it: on a CPU with native bf16, its
    matmul peaks (measured once per machine, even for a plan), None elsewhere."""
    if name != "auto":
        return resolve_precision(name, caps), None
    caps = with_bf16_speedup(caps)
    return resolve_precision(name, caps), precision_weighed(caps)


def _loss_kernel(
    cfg: Config,
    m: ModelConfig,
    policy: PrecisionPolicy,
    loss_chunk: int,
    device: torch.device,
    *,
    timed: bool,
    ctx: DistContext | None,
) -> tuple[str, dict[str, Any] | None]:
    """`train.loss_kernel` for the chunked loss this run makes, and the timing behind it: the
    compile is paid once per process, for the micro-batches it runs (1/dp of the run's); FSDP
    with mixed precision hands the loss its weights and hidden states cast to 16 bits."""
    dp = ctx.dp_size if ctx is not None else 1
    weights = policy.param_dtype
    fsdp = ctx is not None and ctx.strategy == "fsdp"
    if fsdp and fsdp_mixed_precision(policy.autocast_dtype, policy.param_dtype) is not None:
        weights = policy.autocast_dtype
    shape = LossShape(
        tokens=cfg.train.micro_batch_size * cfg.train_seq_len,
        d_model=m.d_model,
        vocab=m.padded_vocab,
        n_valid=m.vocab_size,
        chunk=loss_chunk,
        compute_dtype=policy.compute_dtype,
        param_dtype=weights,
    )
    value, biased = cfg.train.loss_kernel, False
    if loss_chunk and value != "eager":  # the fused kernels take no bias
        biased = hf_head_bias(m) if m.hf else m.head_bias
    if value == "compiled" and biased:  # our GPT's is refused with the config (backends.py)
        warnings.warn(  # a run folder's config.toml may say so (auto chose it before d1584d4)
            "train.loss_kernel compiled: the model's output layer has a bias, which the fused "
            "kernels do not take; ATen's run (eager)",
            stacklevel=2,
        )
        value = "eager"
    return resolve_loss_kernel(
        value,
        shape,
        device,
        cfg.train.max_steps * cfg.grad_accum_steps // dp,
        fusable=cfg.dist.tp == 1 and not biased,
        timed=timed,
    )


def _attention(
    cfg: Config,
    m: ModelConfig,
    policy: PrecisionPolicy,
    device: torch.device,
    *,
    timed: bool,
    ctx: DistContext | None,
) -> tuple[str, dict[str, Any] | None, str | None]:
    """`model.attention`, the timing behind it, and the kernel an eager run takes instead
    (Resolved.attention_if_eager). A run that compiles its blocks (a compile mode set, or
    `auto` on a run long enough to time one) is decided by the kernels compiled: inductor
    fuses blocked attention's softmax into its graph, never SDPA's kernel (model B on the AMX
    Xeon: blocked + compile 1.27x eager, SDPA + compile 1.17x; benchmarks/results/
    step-cuts-B-2026-12-06.md). Where SDPA's fused kernel cannot be recomputed
    (sdpa_recompute_fails), `auto` leaves it out and a setting that asks for it is refused."""
    distributed = ctx is not None and ctx.enabled
    mode = compile_auto.auto_candidate(cfg, device, distributed)
    # several processes compile only regionally (a whole graph is refused: check_distributed)
    compiles = mode == "regional" if distributed else mode != "none"
    # tensor parallelism is always several processes, whether or not `ctx` (a start-up check
    # has none) says so: they compile only regionally
    fails = sdpa_recompute_fails(
        device,
        tensor_parallel=cfg.dist.tp > 1,
        compiles=compile_auto.auto_candidate(cfg, device, True) == "regional",
        recomputes_attention=parse_checkpointing(cfg.memory.checkpointing).recomputes_attention(),
    )
    if cfg.model.hf:
        return _hf_attention(cfg, fails), None, None
    if fails:
        check_sdpa_recompute(m.attention, m.dropout)
    sdpa = not fails or m.dropout > 0  # with dropout SDPA takes its math path on a CPU

    def choice(compiled: bool) -> tuple[str, dict[str, Any] | None]:
        return attention_choice(
            m,
            device,
            policy.compute_dtype,
            attention_call(cfg, m),
            # selective checkpointing, alone, per block or as budget's choice
            keeps_products=any(p in cfg.memory.checkpointing for p in SAVES_PRODUCTS),
            timed=timed,
            compiled=compiled,
            sdpa=sdpa,
        )

    attention, timing = choice(compiles)
    if not (compiles and cfg.train.compile == "auto" and timing and timing.get("compiled")):
        return attention, timing, None
    eager, _ = choice(False)
    leaner = BY_SAVED_BYTES.index(eager) < BY_SAVED_BYTES.index(attention)
    return attention, timing, eager if leaner else None


def _hf_attention(cfg: Config, sdpa_fails: bool) -> str:
    """`model.attention` for a Hugging Face folder: `auto` is its class's default (our CPU
    timing compares our plain kernel, not the model's eager one), transformers' eager
    attention where SDPA's fused kernel cannot run (sdpa_recompute_fails)."""
    name = cfg.model.attention
    if name == "auto":
        return "plain" if sdpa_fails else default_attention(cfg.model)
    if sdpa_fails:  # its attention dropout is config.json's, not model.dropout: taken as none
        check_sdpa_recompute(name, 0.0, hf=True)
    return name


def _gelu_kernel(
    cfg: Config,
    m: ModelConfig,
    policy: PrecisionPolicy,
    device: torch.device,
    *,
    timed: bool,
    ctx: DistContext | None,
) -> tuple[str, dict[str, Any] | None]:
    """`train.gelu_kernel` for the GELU calls this process runs eagerly (each of its layers,
    each of its micro-batches; under tensor parallelism its share of the MLP's width)."""
    dp = ctx.dp_size if ctx is not None else 1
    micro_steps = cfg.train.max_steps * cfg.grad_accum_steps // dp
    skipped = ""
    if device.type != "cpu":
        skipped = "a GPU: ATen's GELU is one fused kernel there"
    elif m.hf or cfg.memory.gelu_bits:
        skipped = "no tanh GELU of onegpu's GPT (a Hugging Face model, or few-bit GELU)"
    elif cfg.train.compile not in ("auto", "none"):
        skipped = f"train.compile {cfg.train.compile} fuses the GELU into its graph"
        if cfg.train.gelu_kernel == "compiled":
            warnings.warn(
                f"train.gelu_kernel compiled: {skipped}, which runs instead", stacklevel=2
            )
    elif micro_steps < MIN_MICRO_BATCHES:
        skipped = f"a run of {micro_steps} micro-batches, under {MIN_MICRO_BATCHES}"
    shape = GeluShape(
        tokens=cfg.train.micro_batch_size * cfg.train_seq_len,
        hidden=m.mlp_ratio * m.d_model // cfg.dist.tp,
        dtype=policy.compute_dtype,
    )
    return resolve_gelu_kernel(
        cfg.train.gelu_kernel,
        shape,
        device,
        micro_steps * m.n_layer // cfg.dist.pp,  # a pipeline stage runs its share of layers
        skipped=skipped,
        timed=timed,
    )


def resolve_agreed(
    cfg: Config, device: torch.device, caps: DeviceCaps | None, ctx: DistContext, *, timed: bool
) -> Resolved:
    """resolve(), with the timed `auto` choices (attention, loss chunk and kernels) made by rank 0 and taken
    by every process: processes timing on their own, at once on a shared machine, can pick
    different kernels, and a tensor-parallel layer must run one kernel on every rank."""
    if not ctx.enabled or not timed:
        return resolve(cfg, device, caps, timed=timed, ctx=ctx)

    def choose() -> tuple[dict[str, str], dict[str, Any]]:
        resolved = resolve(cfg, device, caps, ctx=ctx)
        chosen = resolved.config
        overrides = {
            "train.precision": chosen.train.precision,  # a CPU's: from its timed peaks
            "model.attention": chosen.model.attention,
            "memory.loss_chunk": str(chosen.memory.loss_chunk),
            "train.loss_kernel": chosen.train.loss_kernel,
            "train.gelu_kernel": chosen.train.gelu_kernel,
        }
        timings = {
            "loss_kernel_timing": resolved.loss_kernel_timing,
            "attention_timing": resolved.attention_timing,
            "gelu_kernel_timing": resolved.gelu_kernel_timing,
            "precision_auto": resolved.precision_auto,
        }
        return overrides, timings

    overrides, timings = ctx.on_main(choose)
    agreed = resolve(with_overrides(cfg, overrides), device, caps, ctx=ctx)
    return dataclasses.replace(agreed, **timings)  # rank 0's figures, for every first line
