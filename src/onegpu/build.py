"""The one build path: config -> resolved settings -> model with every technique -> loss ->
optimizer -> the TrainStep. Every command builds through here (train, profile, bench, tune, and
`plan`, which builds the same run on fake tensors), so a technique added here reaches them all.

The model is constructed on the meta device (no memory), the structural techniques are applied,
then it is materialised on the device and initialised (as torchtitan does). With `fake=True` it
is materialised under PyTorch's FakeTensorMode instead: tensors with shapes, dtypes and devices
but no memory, which is how the planner sees the very same run without allocating it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import warnings
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import sdpa_kernel

from onegpu.config import Checkpointing, Config, ConfigError, parse_checkpointing, to_dict
from onegpu.data.tokenizer import FileTokenizer
from onegpu.data.tokens import TokenSplits, prepare_tokens
from onegpu.distributed import DistContext, single_process
from onegpu.distributed.parallelize import (
    apply_ddp,
    apply_fsdp,
    fsdp_mixed_precision,
    materialize_sharded,
)
from onegpu.memory.saved import SavedTensorCounter
from onegpu.models.gpt import GPT, SDPA_BACKENDS, count_params
from onegpu.models.hf import (
    HFModel,
    build_hf_model,
    chunkable_loss,
    default_attention,
    logit_transform,
    open_hf_folder,
    resolve_model_config,
)
from onegpu.optim import build_optimizer
from onegpu.optim.in_backward import OptimizerInBackward
from onegpu.perf.devices import device_key
from onegpu.perf.flops import flops_per_token
from onegpu.step import TrainStep
from onegpu.techniques.approx_grads import apply_approx_grads
from onegpu.techniques.attention import resolve_attention
from onegpu.techniques.checkpointing import apply_checkpointing, selective_cache_tensors
from onegpu.techniques.chunked_loss import chunked_token_loss_sum, resolve_loss_chunk
from onegpu.techniques.compile import (
    MIN_STEPS,
    CompileTrial,
    apply_compile,
    choose_compile,
    time_compile,
)
from onegpu.techniques.loss import LossFn, classification_loss_sum, token_loss_sum
from onegpu.techniques.offload import with_offload
from onegpu.techniques.precision import (
    DeviceCaps,
    PrecisionPolicy,
    apply_precision,
    device_caps,
    resolve_precision,
)

# Their steps cannot run on fake tensors: a fake build steps a stateless stand-in, and the
# planner counts their states from their allocation rules (optim/state_bytes.py).
FAKE_UNSAFE_OPTIMIZERS = ("adafactor", "adamw8bit")
# Optimizers whose step and sharded checkpoints are tested under torchrun (FSDP2's DTensors,
# DDP, Distributed Checkpoint); torchao's 8-bit states and Adafactor's factored ones are not yet.
DIST_OPTIMIZERS = ("adamw", "sgd")


@dataclass(frozen=True, slots=True)
class Resolved:
    """What actually runs, decided once. `config` is the user's config with every `auto`
    filled in (the run folder's config.toml); the user's own object is never changed."""

    device: torch.device
    precision: PrecisionPolicy
    attention: str
    checkpointing: Checkpointing
    config: Config


def resolve_device(name: str, local_rank: int | None = None) -> torch.device:
    """`train.device` as a device; under torchrun (`local_rank` given), 'auto' and 'cuda' mean
    this process's GPU, cuda:LOCAL_RANK."""
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
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(
            "train.device", "CUDA was asked for but no CUDA GPU is visible; use --train.device cpu"
        )
    if (
        device.type == "cuda"
        and device.index is not None
        and device.index >= torch.cuda.device_count()
    ):
        raise ConfigError(
            "train.device", f"{name}: only {torch.cuda.device_count()} CUDA device(s) visible"
        )
    if device.type == "mps" and not torch.backends.mps.is_available():
        raise ConfigError(
            "train.device", "mps was asked for but is not available; use --train.device cpu"
        )
    if device.type not in ("cpu", "cuda", "mps"):
        raise ConfigError("train.device", f"unsupported device type {device.type!r}")
    return device


def resolve(
    cfg: Config, device: torch.device, caps: DeviceCaps | None = None, *, timed: bool = True
) -> Resolved:
    """Precision, attention and the loss chunk for `device` (whose capabilities are `caps`: read
    from the device by default, or from the GPU table when planning for a GPU that is not here).
    `timed` False (a plan): choices that time kernels take what a run here cached, if any."""
    caps_given, caps = caps, caps or device_caps(device)
    policy = resolve_precision(cfg.train.precision, caps)
    model_cfg = resolve_model_config(cfg.model) if cfg.model.hf else cfg.model
    if cfg.model.hf and cfg.model.attention == "auto":
        # the CPU timing compares our plain kernel, not the model's eager one
        attention = default_attention(cfg.model)
    else:
        attention = resolve_attention(
            model_cfg, device, policy.compute_dtype, cfg.train.micro_batch_size
        )
    model_cfg = dataclasses.replace(model_cfg, attention=attention)
    loss_chunk = resolve_loss_chunk(
        cfg.memory.loss_chunk,
        model_cfg,
        cfg.train.micro_batch_size * cfg.train_seq_len,
        policy.compute_dtype,
        device,
        chunkable=chunkable_loss(model_cfg) if cfg.model.hf else True,
        timed=timed and caps_given is None,
    )
    config = dataclasses.replace(
        cfg,
        model=model_cfg,
        train=dataclasses.replace(cfg.train, precision=policy.name),
        memory=dataclasses.replace(cfg.memory, loss_chunk=loss_chunk),
    )
    return Resolved(
        device=device,
        precision=policy,
        attention=attention,
        checkpointing=parse_checkpointing(cfg.memory.checkpointing),
        config=config,
    )


@dataclass(slots=True)
class Applied:
    """What apply_techniques returns: the materialised model, the loss a step calls, and the
    context that holds back DDP's all-reduce in the micro-batches before the last (None: none)."""

    model: nn.Module
    loss_fn: LossFn
    no_sync: Callable[[], contextlib.AbstractContextManager] | None = None
    compile: str = "none"
    """What `train.compile` ran as ('auto' decided)."""
    compile_trial: CompileTrial | None = None
    """The timing `auto` decided from (None: not 'auto', or nothing to decide)."""


def apply_techniques(
    model: nn.Module,
    cfg: Config,
    resolved: Resolved,
    device: torch.device,
    ctx: DistContext | None = None,
) -> Applied:
    """Every technique, in the one documented order (docs/architecture.md), on a model built
    on the meta device; under torchrun (`ctx`), FSDP2 or DDP last of all, as torchtitan does."""
    ctx = ctx or single_process()
    mem, policy = cfg.memory, resolved.precision
    # 1. Approximate-gradient layers first: they swap layers inside the blocks, before anything
    #    wraps the blocks.
    model = apply_approx_grads(
        model, gelu_bits=mem.gelu_bits, randomized_linear=mem.randomized_linear
    )
    # 2. Activation checkpointing wraps whole sub-modules (with the swapped layers inside).
    model = apply_checkpointing(model, resolved.checkpointing)
    # 3. The loss: the output layer and cross-entropy, in chunks if asked for.
    loss_fn = choose_loss(model, mem.loss_chunk)
    # 4. Compile after every module change (dynamo traces what runs, checkpoints included) and
    #    over the loss, so inductor can fuse the loss with the logits it consumes. 'auto' keeps
    #    the eager loss too, and times both once the weights exist (8.).
    mode = auto_compile_candidate(cfg, device, ctx)
    eager, loss_fn = loss_fn, apply_compile(model, loss_fn, mode)
    if ctx.strategy == "fsdp":
        # 5'. FSDP2: shard every block, then the root, still on the meta device; then each
        #     process materialises its shards with the single-process initial weights.
        model = _shard(model, cfg, resolved, device, ctx)
    else:
        # 5. Materialise and initialise in fp32, so every precision starts from the same
        #    weights, then store the weights in the policy's dtype (bf16 for bf16-pure).
        model = materialize(model, device, seed=cfg.train.seed, dtype=policy.param_dtype)
    # 6. Offloading last, outermost: its hooks also see what checkpoints and the chunked loss save.
    if mem.offload_activations:
        eager, loss_fn = with_offload(eager, device), with_offload(loss_fn, device)
    # 7. DDP around the model and its whole loss (its all-reduce follows what runs in forward).
    if ctx.strategy == "ddp":
        loss_fn, no_sync = apply_ddp(model, loss_fn, device)
        return Applied(model, loss_fn, no_sync, compile=mode)
    # 8. `train.compile auto`: eager or compiled, whichever the (cached) timing says pays.
    if cfg.train.compile == "auto" and mode != "none":
        mode, trial = choose_compile(
            f"{device_key(device)}|{_step_fingerprint(cfg)}",
            cfg.train.max_steps * cfg.grad_accum_steps,
            lambda: time_compile(
                model,
                eager,
                loss_fn,
                _trial_batch(cfg, model, device),
                lambda: policy.autocast(device),
                device,
            ),  # fmt: skip
        )
        return Applied(
            model, loss_fn if mode != "none" else eager, compile=mode, compile_trial=trial
        )
    return Applied(model, loss_fn, compile=mode)


def auto_compile_candidate(cfg: Config, device: torch.device, ctx: DistContext) -> str:
    """`train.compile` as set, or for 'auto' the mode to time against eager: 'default' on a
    single-process CPU or CUDA run of at least MIN_STEPS steps, else 'none' (nothing to time)."""
    if cfg.train.compile != "auto":
        return cfg.train.compile
    worth = cfg.train.max_steps >= MIN_STEPS and device.type in ("cpu", "cuda")
    return "default" if worth and not ctx.enabled else "none"


def _step_fingerprint(cfg: Config) -> str:
    """What a micro-batch's forward and backward depend on, as a short stable key."""
    d = to_dict(cfg)
    what = {"model": d["model"], "memory": d["memory"],
            "precision": cfg.train.precision, "batch": [cfg.train.micro_batch_size, cfg.train_seq_len]}  # fmt: skip
    return hashlib.sha256(json.dumps(what, sort_keys=True).encode()).hexdigest()[:16]


def _trial_batch(cfg: Config, model: nn.Module, device: torch.device):
    """A micro-batch of random tokens of the run's shape (targets in the model's output range)."""
    g = torch.Generator().manual_seed(0)
    shape = (cfg.train.micro_batch_size, cfg.train_seq_len)
    x = torch.randint(0, cfg.model.vocab_size, shape, generator=g)
    y = torch.randint(0, model.vocab_size, shape, generator=g)
    return x.to(device), y.to(device)


def _shard(
    model: nn.Module, cfg: Config, resolved: Resolved, device: torch.device, ctx: DistContext
) -> nn.Module:
    policy, d = resolved.precision, cfg.dist
    if policy.param_dtype != torch.float32:  # bf16-pure: the shards are stored in bf16
        model = model.to(policy.param_dtype)
    model = apply_fsdp(
        model,
        reshard_after_forward=d.reshard_after_forward,
        cpu_offload=d.cpu_offload,
        pin_memory=device.type == "cuda",
        mixed_precision=fsdp_mixed_precision(policy.autocast_dtype, policy.param_dtype),
    )

    def reference() -> nn.Module:  # the single-process initial weights, on rank 0's host
        with torch.device("meta"):
            full = make_model(cfg)
        full = apply_approx_grads(
            full, gelu_bits=cfg.memory.gelu_bits, randomized_linear=cfg.memory.randomized_linear
        )
        return materialize(full, torch.device("cpu"), seed=cfg.train.seed, dtype=policy.param_dtype)

    shard_device = torch.device("cpu") if d.cpu_offload else device
    return materialize_sharded(model, shard_device, ctx, reference)


def choose_loss(model: nn.Module, loss_chunk: int) -> LossFn:
    """The model's loss: next-token cross-entropy (chunked through the head's weight if asked
    for), or a classifier's cross-entropy over its labels."""
    if isinstance(model, HFModel) and model.is_classifier:
        if loss_chunk:
            raise ConfigError(
                "memory.loss_chunk",
                "a sequence classifier has no vocabulary-sized logits to chunk; set it to 0",
            )
        return classification_loss_sum
    if not loss_chunk:
        return token_loss_sum
    if isinstance(model, HFModel) and (transform := logit_transform(model)):
        raise ConfigError(
            "memory.loss_chunk",
            f"the model changes its logits after the output layer ({transform} in its "
            "config.json), which the chunked loss would skip; set it to 0",
        )
    return chunked_token_loss_sum(loss_chunk)


def make_model(cfg: Config) -> nn.Module:
    """The architecture, unmaterialised, under the caller's device context."""
    return build_hf_model(cfg.model) if cfg.model.hf else GPT(cfg.model)


def data_tokenizer(cfg: Config):
    """A model folder's own tokenizer, when it has one (else data.tokenizer's)."""
    if not cfg.model.hf:
        return None
    folder = open_hf_folder(cfg.model.hf, cfg.model.hf_head)
    if folder.tokenizer is None:
        return None
    eos = getattr(folder.config, "eos_token_id", None)
    if isinstance(eos, (list, tuple)):
        eos = eos[0] if eos else None
    return FileTokenizer(folder.tokenizer, eos)


def materialize(model: nn.Module, device: torch.device, *, seed: int, dtype: torch.dtype):
    """Meta -> `device`, GPT-2 initialisation from `seed`, weights stored in `dtype` (in place:
    keeps tied parameters tied, and works on fake tensors, where Module.to would swap them)."""
    torch.manual_seed(seed)
    if any(p.is_meta for p in model.parameters()):
        model.to_empty(device=device)
    model.init_weights()
    for p in model.parameters():
        if p.dtype != dtype:
            p.data = p.data.to(dtype)
    return model


@dataclass(slots=True)
class Built:
    """Everything a command needs, from one build."""

    cfg: Config
    """The resolved config: what runs (config.toml)."""
    resolved: Resolved
    model: nn.Module
    optimizer: torch.optim.Optimizer | OptimizerInBackward
    loss_fn: LossFn
    step: TrainStep
    data: TokenSplits | None
    n_params: int
    flops_per_token: int
    classes: int
    """Labels of a sequence classifier (its targets: data.loader.classification_targets);
    0 for a language model."""
    fake_mode: contextlib.AbstractContextManager
    """Enter it to run the step of a fake build (a null context for a real one)."""
    dist: DistContext
    """This process in a torchrun job (strategy 'none': a single-process run)."""
    compile_trial: CompileTrial | None = None
    """The eager-vs-compiled timing `train.compile auto` decided from (None: not timed)."""
    asked: Config | None = None
    """The config as given, its `auto` values unresolved."""

    @property
    def device(self) -> torch.device:
        return self.step.device

    @property
    def policy(self) -> PrecisionPolicy:
        return self.resolved.precision

    def saved_counter(self) -> SavedTensorCounter:
        """Counts the bytes this model saves for backward, selective checkpoints' caches too."""
        return SavedTensorCounter(
            self.model, also_saved=lambda: selective_cache_tensors(self.model)
        )


def build(
    cfg: Config,
    device: torch.device | None = None,
    *,
    with_data: bool = True,
    caps: DeviceCaps | None = None,
    fake: bool = False,
    dist_ctx: DistContext | None = None,
) -> Built:
    """Resolve, prepare data, build the model with its techniques, the optimizer and the step.

    `fake=True` builds on fake CPU tensors for a run on `device` with capabilities `caps` (the
    planner); compile is left out (it changes kernels, not what a step keeps alive). Raises
    ConfigError, before anything is written, for anything this device or data cannot do.
    """
    ctx = dist_ctx or single_process()
    device = device or resolve_device(cfg.train.device, ctx.local_rank if ctx.enabled else None)
    asked, resolved = cfg, resolve(cfg, device, caps, timed=not fake)
    cfg = resolved.config
    check_distributed(cfg, ctx)
    data = None
    if with_data:
        data = ctx.main_first(  # rank 0 tokenizes and caches; the others read its cache
            lambda: prepare_tokens(cfg.data, cfg.model.vocab_size, data_tokenizer(cfg))
        )
        _check_data_sizes(cfg, data)
    if fake:
        from torch._subclasses.fake_tensor import FakeTensorMode

        fake_mode: contextlib.AbstractContextManager = FakeTensorMode(allow_non_fake_inputs=True)
        cfg = _plannable(cfg)
        device = torch.device("cpu")  # fake CPU tensors: CPU shape rules, nothing allocated
    else:
        fake_mode = contextlib.nullcontext()
        apply_precision(resolved.precision, device)
        check_attention_backend(resolved.attention, device, resolved.precision.param_dtype)
    with fake_mode:
        # real: on the meta device, materialised after the techniques; fake: on fake tensors
        # directly (moving meta parameters into a FakeTensorMode cannot swap them)
        with torch.device("cpu" if fake else "meta"):
            model = make_model(cfg)
        applied = apply_techniques(model, cfg, resolved, device, ctx)
        model, loss_fn = applied.model, applied.loss_fn
        cfg = dataclasses.replace(
            cfg, train=dataclasses.replace(cfg.train, compile=applied.compile)
        )
        resolved = dataclasses.replace(resolved, config=cfg)
        optimizer = build_optimizer(
            model,
            cfg.optim,
            torch.device("cpu") if cfg.dist.cpu_offload and ctx.enabled else device,
            param_dtype=resolved.precision.param_dtype,
        )
    step = TrainStep(
        model=model,
        loss_fn=loss_fn,
        optimizer=optimizer,
        policy=resolved.precision,
        device=device,
        optim=cfg.optim,
        max_steps=cfg.train.max_steps,
        n_micro=cfg.grad_accum_steps // ctx.world_size,
        dist=ctx,
        no_sync=applied.no_sync,
    )
    return Built(
        cfg=resolved.config,
        resolved=resolved,
        model=model,
        optimizer=optimizer,
        loss_fn=loss_fn,
        step=step,
        data=data,
        n_params=count_params(model),
        flops_per_token=flops_per_token(model, cfg.train_seq_len),
        classes=model.lm_head.out_features if getattr(model, "is_classifier", False) else 0,
        fake_mode=fake_mode,
        dist=ctx,
        compile_trial=applied.compile_trial,
        asked=asked,
    )


def check_distributed(cfg: Config, ctx: DistContext) -> None:
    """What several processes need of the config; ConfigError naming the field otherwise."""
    t, d = cfg.train, cfg.dist
    if not ctx.enabled:
        if d.cpu_offload:
            raise ConfigError(
                "dist.cpu_offload",
                "offloads FSDP's shards, so it needs dist.strategy fsdp under torchrun "
                "(`torchrun --nproc-per-node 1 -m onegpu train --dist.strategy fsdp ...` on one "
                "device); for activations use memory.offload_activations",
            )
        return
    if t.compile in ("default", "max-autotune"):
        raise ConfigError(
            "train.compile",
            f"{t.compile!r} compiles the whole step, which does not trace FSDP/DDP's "
            "communication here; use 'regional' (per-block compile, as torchtitan does)",
        )
    if cfg.optim.in_backward:
        raise ConfigError(
            "optim.in_backward",
            "is not supported with several processes (gradients are reduced after backward); "
            "turn it off",
        )
    if ctx.strategy == "fsdp" and t.precision == "fp16":
        raise ConfigError(
            "train.precision",
            "fp16 loss scaling over FSDP shards is not supported; use bf16 (no loss scaling)",
        )
    if t.precision == "bf16-pure":
        raise ConfigError(
            "train.precision",
            "bf16-pure's Kahan-compensated optimizer states do not go through sharded "
            "checkpoints yet; use bf16 (under FSDP: bf16 compute on fp32 master shards, each "
            "process holding 1/N of them)",
        )
    if cfg.optim.name not in DIST_OPTIMIZERS:
        raise ConfigError(
            "optim.name",
            f"{cfg.optim.name} is not supported with several processes yet; use "
            f"{' or '.join(DIST_OPTIMIZERS)}",
        )
    n = ctx.world_size
    if t.batch_size % (t.micro_batch_size * n):
        raise ConfigError(
            "train.batch_size",
            f"the global batch {t.batch_size} does not split into {n} processes x micro-batches "
            f"of {t.micro_batch_size}; use a multiple of {t.micro_batch_size * n}",
        )
    if d.cpu_offload and ctx.strategy != "fsdp":
        raise ConfigError("dist.cpu_offload", "offloads FSDP's shards; use dist.strategy fsdp")


def _plannable(cfg: Config) -> Config:
    """The config a fake build runs: no compile, and a stateless stand-in for optimizers that
    cannot step fake tensors."""
    optim = cfg.optim
    if optim.name in FAKE_UNSAFE_OPTIMIZERS:
        optim = dataclasses.replace(optim, name="sgd", beta1=0.0)
    return dataclasses.replace(
        cfg, train=dataclasses.replace(cfg.train, compile="none"), optim=optim
    )


def check_attention_backend(name: str, device: torch.device, dtype: torch.dtype) -> None:
    """Fail early, with a fix, if the SDPA kernel asked for does not exist on this device."""
    if name not in SDPA_BACKENDS:
        return
    q = torch.zeros(1, 1, 8, 8, device=device, dtype=dtype, requires_grad=True)
    try:
        with warnings.catch_warnings(), sdpa_kernel(SDPA_BACKENDS[name]):
            warnings.simplefilter("ignore")  # torch explains why each kernel was not used
            F.scaled_dot_product_attention(q, q, q, is_causal=True).sum().backward()
    except RuntimeError:
        raise ConfigError(
            "model.attention",
            f"the SDPA {name!r} kernel is not available on {device.type} for {dtype}; "
            "use 'sdpa' (the fastest available kernel) or 'math'",
        ) from None


def _check_data_sizes(cfg: Config, data: TokenSplits) -> None:
    T = cfg.train_seq_len
    need = cfg.train.batch_size * T + 1
    if len(data.train) < need:
        raise ConfigError(
            "data.source",
            f"the training split has {len(data.train)} tokens, fewer than one batch "
            f"(train.batch_size * seq_len + 1 = {need}); use more data or a smaller batch/seq_len",
        )
    if cfg.train.eval_every and len(data.val) < T + 1:
        raise ConfigError(
            "data.val_fraction",
            f"the validation split has {len(data.val)} tokens, fewer than one sequence ({T + 1}); "
            "raise data.val_fraction or turn evaluation off with --train.eval_every 0",
        )


__all__ = ["Built", "Resolved", "apply_techniques", "build", "resolve", "resolve_device"]
