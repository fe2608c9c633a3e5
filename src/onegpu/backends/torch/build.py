"""The one build path: config -> resolved settings -> model with every technique -> loss ->
optimizer -> the TrainStep. Every command builds through here (train, profile, bench, tune, and
`plan`, which builds the same run on fake tensors), so a technique added here reaches them all.

- resolve.py: the device and every `auto` (each decided in its own technique module)
- model.py: construction on the meta device, the techniques in their order, materialisation
- data.py: the token splits (and a model folder's tokenizer)

The model is constructed on the meta device (no memory), the structural techniques are applied,
then it is materialised on the device and initialised (as torchtitan does). With `fake=True` it
is materialised under PyTorch's FakeTensorMode instead: tensors with shapes, dtypes and devices
but no memory, which is how the planner sees the very same run without allocating it.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from onegpu.backends.torch.data import data_tokenizer, prepare_data
from onegpu.backends.torch.model import Applied, apply_techniques, make_model, materialize
from onegpu.backends.torch.resolve import Resolved, resolve, resolve_agreed, resolve_device
from onegpu.backends.torch.step import TrainStep, reuses_casts
from onegpu.config import LOW_RANK_OPTIMIZERS, Config, ConfigError, check_distributed
from onegpu.config.data import PACKED
from onegpu.config.schedule import scaled_optim
from onegpu.data.splits import TokenSplits
from onegpu.distributed import DistContext, init_distributed, single_process
from onegpu.distributed.context import shutdown
from onegpu.memory.saved import SavedTensorCounter
from onegpu.models.documents import isolates_documents
from onegpu.models.gpt import count_params
from onegpu.models.protocol import LanguageModel, LossFn
from onegpu.offload.homes import homes
from onegpu.offload.host_optimizer import HostOffloadOptimizer
from onegpu.offload.weights import with_offload_params
from onegpu.optim import build_optimizer
from onegpu.optim.factory import STAND_IN
from onegpu.optim.in_backward import PerParameterOptimizers
from onegpu.perf.flops import flops_per_token
from onegpu.techniques import causal_softmax_cpu
from onegpu.techniques.attention import check_attention_backend
from onegpu.techniques.checkpointing import selective_cache_tensors
from onegpu.techniques.compile_auto import CompileTrial
from onegpu.techniques.precision import DeviceCaps, PrecisionPolicy, apply_precision

# Their steps cannot run on fake tensors: a fake build steps a stateless stand-in, and the
# planner counts their states from their allocation rules (optim/state_bytes.py).
FAKE_UNSAFE_OPTIMIZERS = (
    "adam-mini",
    "adafactor",
    "adamw8bit",
    "adamw4bit",
    "lamb",
    "lars",
    *LOW_RANK_OPTIMIZERS,
)


@dataclass(slots=True)
class Built:
    """Everything a command needs, from one build."""

    cfg: Config
    """The resolved config: what runs (config.toml)."""
    resolved: Resolved
    model: LanguageModel
    optimizer: torch.optim.Optimizer | PerParameterOptimizers | HostOffloadOptimizer
    loss_fn: LossFn
    step: TrainStep
    data: TokenSplits | None
    n_params: int
    flops_per_token: int
    classes: int
    """Labels of a sequence classifier (its targets: batches.classification_targets);
    0 for a language model."""
    fake_mode: contextlib.AbstractContextManager
    """Enter it to run the step of a fake build (a null context for a real one)."""
    dist: DistContext
    """This process in a torchrun job (strategy 'none': a single-process run)."""
    compile_trial: CompileTrial | None = None
    """The eager-vs-compiled timing `train.compile auto` decided from (None: not timed)."""
    asked: Config | None = None
    """The config as given, its `auto` values unresolved."""
    comm_state: Any = None
    """DDP's gradient compression state (PowerSGD's), checkpointed per process."""

    @property
    def device(self) -> torch.device:
        return self.step.device

    @property
    def policy(self) -> PrecisionPolicy:
        return self.resolved.precision

    def homes(self) -> dict[str, str]:
        """Where optimizer states, weights and saved activations live (offload/homes.py)."""
        on_host = self.dist.enabled and self.cfg.dist.cpu_offload
        return homes(self.optimizer, self.loss_fn, weights_on_host=on_host)

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
    causal_softmax_cpu.register()  # onegpu's CPU kernel for blocked attention's softmax
    cfg, ctx = _processes(cfg, dist_ctx, fake)
    device = device or resolve_device(cfg.train.device, ctx.local_rank if ctx.enabled else None)
    asked, resolved = cfg, resolve_agreed(cfg, device, caps, ctx, timed=not fake)
    cfg = resolved.config
    check_distributed(cfg, ctx.strategy, ctx.world_size)
    data = prepare_data(cfg, ctx) if with_data else None
    fake_mode, device = _tensors(cfg, resolved, device, fake)
    if fake:
        cfg = plannable(cfg)
    with fake_mode:
        applied = _model_with_techniques(cfg, resolved, device, ctx, fake)
        cfg = _as_applied(cfg, applied)
        resolved = dataclasses.replace(resolved, config=cfg)
        model = applied.model
        optimizer = _optimizer(model, cfg, resolved, device, ctx, fake)
    if model.is_classifier and data is not None and data.packing != "stream":
        raise ConfigError(
            "data.packing",
            f"{data.packing}: a sequence classifier reads windows of the token stream; use stream",
        )
    if not fake and cfg.model.hf and cfg.data.packing in PACKED:
        _require_isolation(model, cfg, device)
    step = _train_step(cfg, applied, optimizer, resolved, device, ctx)
    whole = model if not applied.pipeline else _whole_model(cfg)

    return Built(
        cfg=resolved.config,
        resolved=resolved,
        model=model,
        optimizer=optimizer,
        loss_fn=applied.loss_fn,
        step=step,
        data=data,
        n_params=count_params(whole),
        flops_per_token=flops_per_token(whole, cfg.train_seq_len),
        classes=model.lm_head.out_features if model.is_classifier else 0,
        fake_mode=fake_mode,
        dist=ctx,
        compile_trial=applied.compile_trial,
        asked=asked,
        comm_state=applied.comm_state,
    )


def _as_applied(cfg: Config, applied: Applied) -> Config:
    """The config as the model was built: what `train.compile auto` ran as, and the attention
    kernel where its staying eager changed it."""
    attention = applied.attention or cfg.model.attention
    return dataclasses.replace(
        cfg,
        train=dataclasses.replace(cfg.train, compile=applied.compile),
        model=dataclasses.replace(cfg.model, attention=attention),
    )


def _require_isolation(model: LanguageModel, cfg: Config, device: torch.device) -> None:
    """Packed rows on a transformers model: refused where its forward does not keep the
    documents apart (models/documents.py's probe), before any step trains on cross-talk."""
    if not isolates_documents(model, model.vocab_size, device):
        raise ConfigError(
            "data.packing",
            f"{cfg.data.packing}: {type(model.hf).__name__} does not keep packed documents "
            "apart (its attention or positions ignore position_ids); use none",
        )


def _whole_model(cfg: Config) -> LanguageModel:
    """The whole architecture on the meta device (a pipeline stage holds only part of it):
    what the parameter count and the FLOPs per token describe."""
    with torch.device("meta"):
        return make_model(cfg.model)


def _train_step(
    cfg: Config,
    applied: Applied,
    optimizer: torch.optim.Optimizer | PerParameterOptimizers | HostOffloadOptimizer,
    resolved: Resolved,
    device: torch.device,
    ctx: DistContext,
) -> TrainStep:
    return TrainStep(
        model=applied.model,
        loss_fn=applied.loss_fn,
        optimizer=optimizer,
        policy=resolved.precision,
        device=device,
        optim=scaled_optim(cfg),
        max_steps=cfg.train.max_steps,
        n_micro=cfg.grad_accum_steps // ctx.dp_size,
        dist=ctx,
        no_sync=applied.no_sync,
        loss_context=applied.loss_context,
        pipeline=applied.pipeline,
        reuse_casts=reuses_casts(cfg, ctx),
    )


def _optimizer(
    model: LanguageModel,
    cfg: Config,
    resolved: Resolved,
    device: torch.device,
    ctx: DistContext,
    fake: bool,
) -> torch.optim.Optimizer | PerParameterOptimizers | HostOffloadOptimizer:
    on_host = cfg.dist.cpu_offload and ctx.enabled  # FSDP's shards live on the host
    return build_optimizer(
        model,
        cfg.optim,
        torch.device("cpu") if on_host else device,
        param_dtype=resolved.precision.param_dtype,
        offload=cfg.memory.offload_optimizer,
        offload_dir=cfg.memory.offload_dir,
        states_on_host=cfg.memory.offload_states,
        sixteen_bit_weights=resolved.precision.name == "bf16",
        # the chunked loss sums the output layer's gradient in fp32 over its chunks: that
        # weight stays fp32, so the gradient is the plain run's to the bit
        keep_head=bool(resolved.config.memory.loss_chunk),
        fake=fake,
        seed=cfg.train.seed,
    )


def _tensors(
    cfg: Config, resolved: Resolved, device: torch.device, fake: bool
) -> tuple[contextlib.AbstractContextManager, torch.device]:
    """Where the build's tensors live: fake CPU tensors (CPU shape rules, nothing allocated)
    for a plan, else `device`, with its precision settings and attention kernel checked."""
    if fake:
        from torch._subclasses.fake_tensor import FakeTensorMode

        return FakeTensorMode(allow_non_fake_inputs=True), torch.device("cpu")
    apply_precision(resolved.precision, device)
    check_attention_backend(resolved.attention, device, resolved.precision.param_dtype)
    return contextlib.nullcontext(), device


@contextlib.contextmanager
def processes(cfg: Config) -> Iterator[DistContext]:
    """The processes a real build runs on, closed when the caller is done with it: torchrun's,
    or, for weights offloaded to the host (FSDP2's CPU offload, offload/weights.py), a group of
    this one process. A group left open would outlive its build and stop the next one (or the
    planner's fake group) from opening."""
    cfg = with_offload_params(cfg)
    device_type = resolve_device(cfg.train.device).type
    ctx = init_distributed(cfg.dist, device_type, alone=cfg.memory.offload_params)
    try:
        yield ctx
    finally:
        shutdown(ctx)


def _processes(cfg: Config, dist_ctx: DistContext | None, fake: bool) -> tuple[Config, DistContext]:
    """The caller's processes (`processes` above). A fake build plans one process's share: the
    planner applies the same rewrite to its figures."""
    if not fake:
        cfg = with_offload_params(cfg)
        if dist_ctx is None and cfg.memory.offload_params:
            raise RuntimeError("weights on the host need a process group: build inside processes()")
    return cfg, dist_ctx or single_process()


def _model_with_techniques(
    cfg: Config, resolved: Resolved, device: torch.device, ctx: DistContext, fake: bool
) -> Applied:
    # real: on the meta device, materialised after the techniques; fake: on fake tensors
    # directly (moving meta parameters into a FakeTensorMode cannot swap them), but a plan of
    # a sharded or split rank on the meta device too: FSDP and the mesh work outside the fake
    # mode, on weights that allocate nothing, and then its shards become fake tensors
    sharded = ctx.strategy == "fsdp" or ctx.layout.tp > 1
    with torch.device("cpu" if fake and not sharded else "meta"):
        model = make_model(cfg.model)
    return apply_techniques(model, cfg, resolved, device, ctx)


def plannable(cfg: Config) -> Config:
    """The config a fake build runs: no compile, and a stateless stand-in for optimizers that
    cannot step fake tensors, holding what their step holds (optim/state_bytes.py)."""
    optim = cfg.optim
    if optim.name in FAKE_UNSAFE_OPTIMIZERS:
        optim = dataclasses.replace(optim, name=f"{STAND_IN}:{optim.name}", beta1=0.0)
    return dataclasses.replace(
        cfg, train=dataclasses.replace(cfg.train, compile="none"), optim=optim
    )


__all__ = [
    "FAKE_UNSAFE_OPTIMIZERS",
    "Applied",
    "Built",
    "Resolved",
    "apply_techniques",
    "build",
    "data_tokenizer",
    "make_model",
    "materialize",
    "plannable",
    "resolve",
    "resolve_device",
]
