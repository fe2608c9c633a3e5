"""The one build path: config -> model -> techniques -> optimizer, and data.

Every command (train, and later plan/tune/bench/profile) calls `build`. The model is constructed
on the meta device (no memory), techniques are applied in a fixed order, then it is materialised
on the target device and initialised; on device "meta" it stays unallocated, which is how the
memory planner sees the very same model.
"""

from __future__ import annotations

import dataclasses
import warnings
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch.nn.attention import sdpa_kernel

from onegpu.config import Config, ConfigError
from onegpu.data.tokens import TokenSplits, prepare_tokens
from onegpu.models.gpt import GPT, SDPA_BACKENDS, count_params
from onegpu.optim import build_optimizer
from onegpu.optim.in_backward import OptimizerInBackward
from onegpu.perf.flops import flops_per_token
from onegpu.techniques.approx_grads import apply_approx_grads
from onegpu.techniques.attention import resolve_attention
from onegpu.techniques.checkpointing import apply_checkpointing
from onegpu.techniques.chunked_loss import chunked_token_loss_sum
from onegpu.techniques.compile import apply_compile
from onegpu.techniques.loss import LossFn, token_loss_sum
from onegpu.techniques.offload import with_offload
from onegpu.techniques.precision import PrecisionPolicy, apply_precision, resolve_precision


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
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
    if device.type not in ("cpu", "cuda", "mps", "meta"):
        raise ConfigError("train.device", f"unsupported device type {device.type!r}")
    return device


def apply_techniques(model: GPT, cfg: Config) -> GPT:
    """Model-changing techniques in their documented order: precision policy (autocast: no
    model change) -> approximate-gradient layers -> activation checkpointing -> compile.
    Checkpointing wraps whole sub-modules, so it comes after layers are swapped inside them."""
    mem = cfg.memory
    model = apply_approx_grads(
        model, gelu_bits=mem.gelu_bits, randomized_linear=mem.randomized_linear
    )
    return apply_checkpointing(model, mem.checkpointing)


def build_loss(cfg: Config, device: torch.device, model: GPT) -> LossFn:
    """The step's loss: chunked output layer if asked for, then compiled (whole or regional)
    if asked for, then saved tensors offloaded if asked for (outermost, so it also sees the
    tensors the chunked loss saves)."""
    loss_fn = (
        chunked_token_loss_sum(cfg.memory.loss_chunk) if cfg.memory.loss_chunk else token_loss_sum
    )
    if device.type != "meta":
        loss_fn = apply_compile(model, loss_fn, cfg.train.compile)
    if cfg.memory.offload_activations:
        loss_fn = with_offload(loss_fn, device)
    return loss_fn


@dataclass(slots=True)
class Built:
    cfg: Config
    device: torch.device
    model: GPT
    policy: PrecisionPolicy
    optimizer: torch.optim.Optimizer | OptimizerInBackward | None
    loss_fn: LossFn
    data: TokenSplits | None
    n_params: int
    flops_per_token: int


def build_model(cfg: Config, device: torch.device, param_dtype: torch.dtype = torch.float32) -> GPT:
    """Construct on meta, apply techniques, materialise and initialise (in fp32, so every
    precision starts from the same weights), then store in param_dtype (bf16 for bf16-pure)."""
    with torch.device("meta"):
        model = GPT(cfg.model)
    model = apply_techniques(model, cfg)
    if device.type != "meta":
        torch.manual_seed(cfg.train.seed)
        model.to_empty(device=device)
        model.init_weights()
    return cast_parameters_(model, param_dtype)


def cast_parameters_(model: GPT, dtype: torch.dtype) -> GPT:
    """Store parameters in `dtype`, in place (keeps tied parameters tied; works on fake
    tensors, where Module.to would have to swap tensors)."""
    for p in model.parameters():
        if p.dtype != dtype:
            p.data = p.data.to(dtype)
    return model


def build_plan_parts(cfg: Config) -> tuple[GPT, PrecisionPolicy, Any, LossFn]:
    """Model, precision policy, optimizer and loss exactly as `build` makes them, to be called
    under FakeTensorMode (the planner): tensors are CPU-shaped fakes, nothing is allocated."""
    device = torch.device("cpu")
    policy = resolve_precision(cfg.train.precision, device)
    cfg.train.precision = policy.name
    if cfg.model.attention == "auto":
        cfg.model.attention = "sdpa"  # the planner resolves it first; this is the fallback
    with device:
        model = apply_techniques(GPT(cfg.model), cfg)
    model.init_weights()
    cast_parameters_(model, policy.param_dtype)
    optim_cfg = cfg.optim
    if optim_cfg.name in FAKE_UNSAFE_OPTIMIZERS:
        # their steps cannot run on fake tensors: a stateless stand-in steps, and the planner
        # counts their states from their allocation rules (optim/state_bytes.py)
        optim_cfg = dataclasses.replace(optim_cfg, name="sgd", beta1=0.0)
    optimizer = build_optimizer(model, optim_cfg, device)
    return model, policy, optimizer, build_loss(cfg, device, model)


FAKE_UNSAFE_OPTIMIZERS = ("adafactor", "adamw8bit")


def build(
    cfg: Config,
    device: torch.device | None = None,
    *,
    with_data: bool = True,
    with_optimizer: bool = True,
) -> Built:
    """Resolve device and precision, prepare data, build model and optimizer.

    Raises ConfigError (before anything is written) for anything this device or data cannot do.
    """
    device = device or resolve_device(cfg.train.device)
    policy = resolve_precision(cfg.train.precision, device)
    cfg.train.precision = policy.name  # the resolved config says what actually ran
    data = prepare_tokens(cfg.data, cfg.model.vocab_size) if with_data else None
    if data is not None:
        _check_data_sizes(cfg, data)
    apply_precision(policy, device)
    if device.type != "meta":
        cfg.model.attention = resolve_attention(
            cfg.model, device, policy.compute_dtype, cfg.train.micro_batch_size
        )  # the resolved config says what ran
        check_attention_backend(cfg.model.attention, device, policy.param_dtype)
    model = build_model(cfg, device, policy.param_dtype)
    optimizer = (
        build_optimizer(model, cfg.optim, device)
        if with_optimizer and device.type != "meta"
        else None
    )
    return Built(
        cfg=cfg,
        device=device,
        model=model,
        policy=policy,
        optimizer=optimizer,
        loss_fn=build_loss(cfg, device, model),
        data=data,
        n_params=count_params(model),
        flops_per_token=flops_per_token(model, cfg.train_seq_len),
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


__all__ = ["Built", "build", "build_model", "build_plan_parts", "resolve_device"]
