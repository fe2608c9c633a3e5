"""The model a run trains: constructed on the meta device, every technique applied in the one
documented order (docs/architecture.md), then materialised and initialised (as torchtitan does),
or sharded across processes under torchrun."""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch._subclasses.fake_tensor import is_fake

from onegpu.backends.torch.resolve import Resolved
from onegpu.config import Config, ConfigError, ModelConfig
from onegpu.distributed import DistContext
from onegpu.distributed.hf_tensor_parallel import apply_hf_tensor_parallel
from onegpu.distributed.parallelize import (
    apply_ddp,
    apply_fsdp,
    fsdp_mixed_precision,
    materialize_sharded,
)
from onegpu.distributed.pipeline import (
    Pipeline,
    build_pipeline,
    prune,
    split_blocks,
    stage_indices,
    stages_per_process,
)
from onegpu.distributed.tensor_parallel import (
    apply_tensor_parallel,
    loss_parallel_context,
    vocab_parallel_loss,
)
from onegpu.models.gpt import GPT
from onegpu.models.hf import build_hf_model
from onegpu.models.protocol import LanguageModel, LossFn
from onegpu.models.qkv import split_fused_qkv
from onegpu.offload.activations import with_offload
from onegpu.techniques import compile as compile_
from onegpu.techniques import compile_auto
from onegpu.techniques.approx_grads import apply_approx_grads
from onegpu.techniques.attention import on_attention, restrict_sdpa_kernel, use_attention
from onegpu.techniques.checkpointing import apply_checkpointing
from onegpu.techniques.chunked_loss import chunked_token_loss_sum, vocab_parallel_chunked_loss
from onegpu.techniques.gelu_kernel import use_gelu_kernel
from onegpu.techniques.loss import classification_loss_sum, logits_loss_sum, token_loss_sum
from onegpu.techniques.loss_kernels import LossKernels, kernels_for


@dataclass(slots=True)
class Applied:
    """What apply_techniques returns: the materialised model, the loss a step calls, and the
    context that holds back DDP's all-reduce in the micro-batches before the last (None: none)."""

    model: LanguageModel
    loss_fn: LossFn
    no_sync: Callable[[], contextlib.AbstractContextManager] | None = None
    loss_context: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext
    """What each micro-batch's forward and backward run in (tensor parallelism's
    `loss_parallel`, whose cross-entropy reads vocabulary-sharded logits both ways)."""
    pipeline: Pipeline | None = None
    """Pipeline parallelism: the schedule a step runs instead of its micro-batch loop."""
    comm_state: Any = None
    """DDP's gradient compression state (PowerSGD's error feedback), saved with checkpoints."""
    compile: str = "none"
    """What `train.compile` ran as ('auto' decided)."""
    compile_trial: compile_auto.CompileTrial | None = None
    """The timing `auto` decided from (None: not 'auto', or nothing to decide)."""
    attention: str | None = None
    """The attention kernel, where `train.compile auto` staying eager changed it (None: as
    resolved)."""


def _compile_auto(
    model: LanguageModel,
    raw: LossFn,
    eager: LossFn,
    cfg: Config,
    resolved: Resolved,
    device: torch.device,
) -> Applied:
    """`train.compile auto` on the materialised model: eager or a compile mode, whichever the
    (cached) timing says saves the most over the run. Where compiled timings picked another
    attention kernel than eager ones (`Resolved.attention_if_eager`), the trial weighs each
    mode on its own pick against eager on the leaner eager one, and a run that stays eager
    takes that one."""
    policy, offloads = resolved.precision, cfg.memory.offload_activations
    autocast = lambda: policy.autocast(device)  # noqa: E731
    wrap = (lambda f: with_offload(f, device)) if offloads else (lambda f: f)
    candidates = compile_.auto_candidates(model, raw, wrap, device)
    if eager_pick := resolved.attention_if_eager:
        candidates = {
            m: on_attention(c, model, cfg.model.attention, eager_pick)
            for m, c in candidates.items()
        }
        use_attention(model, eager_pick)
    mode, trial = compile_auto.decide(cfg, model, eager, candidates, autocast, device)
    chosen = candidates[mode].enter() if mode != "none" else eager
    attention = eager_pick if mode == "none" else None
    return Applied(model, chosen, compile=mode, compile_trial=trial, attention=attention)


def make_model(m: ModelConfig) -> LanguageModel:
    """The architecture, unmaterialised, under the caller's device context."""
    return build_hf_model(m) if m.hf else GPT(m)


def apply_techniques(
    model: LanguageModel, cfg: Config, resolved: Resolved, device: torch.device, ctx: DistContext
) -> Applied:
    """Every technique, in the one documented order (docs/architecture.md), on a model built
    on the meta device; under torchrun (`ctx`), FSDP2 or DDP last of all, as torchtitan does."""
    mem, policy = cfg.memory, resolved.precision
    # 1. Approximate-gradient layers first: they swap layers inside the blocks, before anything
    #    wraps the blocks.
    model = apply_approx_grads(
        model, gelu_bits=mem.gelu_bits, randomized_linear=mem.randomized_linear
    )
    # 1b. Tensor parallelism splits the layers by their names, before checkpointing wraps them
    #     (torchtitan's order: TP, activation checkpointing, compile, FSDP).
    model = split_tensors(model, ctx)
    #     A Hugging Face model's attention on the SDPA kernel asked for, before checkpointing
    #     wraps it (its recompute then runs the same kernel).
    model = restrict_sdpa_kernel(model, resolved.attention)
    #     Pipeline parallelism keeps this process's stages' modules, under their own names.
    model, ranges, stages = keep_stages(model, cfg, ctx)
    # 2. Activation checkpointing wraps whole sub-modules (with the swapped layers inside).
    model = apply_checkpointing(model, resolved.checkpointing)
    # 3. The loss: the output layer and cross-entropy, in chunks if asked for (under tensor
    #    parallelism on vocabulary-sharded logits, never gathered).
    loss_fn, loss_context = split_loss(model, mem.loss_chunk, ctx, cfg.train.loss_kernel)
    #    The eager GELU's kernel (a plan's fake tensors run ATen's: the same allocations).
    use_gelu_kernel(model, "eager" if planning() else cfg.train.gelu_kernel)
    # 4. Compile after every module change (dynamo traces what runs, checkpoints included) and
    #    over the loss, so inductor can fuse the loss with the logits it consumes. 'auto' keeps
    #    the eager loss too, and times both once the weights exist (8.).
    mode = compile_auto.auto_candidate(cfg, device, distributed=ctx.enabled)
    timed = cfg.train.compile == "auto" and mode != "none"  # decided in 8., once materialised
    raw = eager = loss_fn
    loss_fn = compile_.apply_compile(model, loss_fn, "none" if timed else mode, device)
    # 5. Materialise and initialise in fp32, so every precision starts from the same weights,
    #    then store them in the policy's dtype (bf16 for bf16-pure). Under FSDP2: shard every
    #    block, then the root, still on the meta device; each process then materialises its
    #    shards with the single-process initial weights.
    if ctx.strategy == "fsdp" or ctx.layout.splits_model:
        model = shard(model, cfg, resolved, device, ctx)
    else:
        model = materialize(
            model,
            device,
            seed=cfg.train.seed,
            dtype=policy.param_dtype,
            init_from=cfg.model.init_from,
        )
    # 6. Offloading last, outermost: its hooks also see what checkpoints and the chunked loss save.
    if mem.offload_activations:
        eager, loss_fn = with_offload(eager, device), with_offload(loss_fn, device)
    # 7. DDP around the model and its whole loss (its all-reduce follows what runs in forward).
    if ctx.strategy == "ddp":
        loss_fn, no_sync, comm = apply_ddp(model, loss_fn, device, cfg.dist.grad_compression)
        return Applied(model, loss_fn, no_sync, compile=mode, comm_state=comm)
    # 8. `train.compile auto`: eager or a compile mode, whichever the (cached) timing says
    #    saves the most over the run.
    if timed:
        return _compile_auto(model, raw, eager, cfg, resolved, device)
    pipeline = make_pipeline(model, cfg, resolved, device, ctx, ranges, stages) if stages else None
    return Applied(model, loss_fn, compile=mode, loss_context=loss_context, pipeline=pipeline)


def shard(
    model: LanguageModel, cfg: Config, resolved: Resolved, device: torch.device, ctx: DistContext
) -> LanguageModel:
    """FSDP2 over the meta model (on the data-parallel mesh dimensions, when it is on) and
    the model's split weights (tensor parallelism) filled from rank 0's host copy of the very
    same construction, materialised as a single process would (same seed, same draws)."""
    policy, d = resolved.precision, cfg.dist
    planned = planning()  # a plan's rank: its shards are fake tensors, their values never read
    template = reference_template(model, cfg) if ctx.is_main and not planned else None
    if policy.param_dtype != torch.float32:  # bf16-pure: the shards are stored in bf16
        model = model.to(policy.param_dtype)
    if ctx.strategy == "fsdp":
        with outside_fake_mode():  # on the meta device: FSDP's meshes are made real
            model = apply_fsdp(
                model,
                reshard_after_forward=d.reshard_after_forward,
                cpu_offload=d.cpu_offload,
                pin_memory=device.type == "cuda",
                mixed_precision=fsdp_mixed_precision(policy.autocast_dtype, policy.param_dtype),
                mesh=ctx.submesh("dp_replicate", "dp_shard"),
                forward_methods=("stage",) if ctx.layout.pp > 1 else ("hidden",),
            )

    def reference() -> nn.Module:  # only rank 0 calls it
        cpu = torch.device("cpu")
        return materialize(
            template,
            cpu,
            seed=cfg.train.seed,
            dtype=policy.param_dtype,
            init_from=cfg.model.init_from,
        )

    if planned:  # (meta where FSDP or the mesh sharded it, else fake already)
        meta = any(p.is_meta for p in model.parameters())
        return model.to_empty(device=torch.device("cpu")) if meta else model
    shard_device = torch.device("cpu") if d.cpu_offload else device
    return materialize_sharded(model, shard_device, ctx, reference, whole=ctx.layout.pp == 1)


def split_tensors(model: LanguageModel, ctx: DistContext) -> LanguageModel:
    """Tensor parallelism over the mesh's tp dimension (the model as it is without one)."""
    tp_mesh = ctx.submesh("tp")
    if tp_mesh is None:
        return model
    split = apply_hf_tensor_parallel if model.cfg.hf else apply_tensor_parallel
    with outside_fake_mode():  # meta weights: nothing is allocated; meshes are made real
        return split(model, tp_mesh)


def split_loss(
    model: LanguageModel, loss_chunk: int, ctx: DistContext, loss_kernel: str = "eager"
) -> tuple[LossFn, Callable[[], contextlib.AbstractContextManager]]:
    """The loss and the context its forward and backward run in: under tensor parallelism
    cross-entropy on vocabulary-sharded logits (`loss_parallel`), or, chunked, on each
    process's vocabulary rows a chunk at a time. `loss_kernel`: the chunked loss's per-chunk
    kernels, compiled or ATen's (a plan's fake tensors take the compiled ones' footprints)."""
    kernels = kernels_for(loss_kernel, planning=planning())
    loss_fn = choose_loss(model, loss_chunk, kernels)
    if ctx.submesh("tp") is None:
        return loss_fn, contextlib.nullcontext
    if loss_chunk and not model.is_classifier:
        return vocab_parallel_chunked_loss(loss_chunk), contextlib.nullcontext
    return vocab_parallel_loss(loss_fn), loss_parallel_context()


def keep_stages(
    model: LanguageModel, cfg: Config, ctx: DistContext
) -> tuple[LanguageModel, list[range], list[int]]:
    """The model pruned to this process's pipeline stages, every stage's blocks, and this
    process's stages (the model as it is, [], [] without pipeline parallelism)."""
    ranges, stages = pipeline_stages(cfg, ctx)
    if stages:
        blocks = {i for stage in stages for i in ranges[stage]}
        model = prune(model, blocks, first=0 in stages, last=len(ranges) - 1 in stages)
    return model, ranges, stages


def pipeline_stages(cfg: Config, ctx: DistContext) -> tuple[list[range], list[int]]:
    """Every stage's blocks and the stages this process runs ([] without pipeline parallelism)."""
    d = cfg.dist
    if ctx.layout.pp == 1:
        return [], []
    n_stages = ctx.layout.pp * stages_per_process(d.pp_schedule)
    ranges = split_blocks(cfg.model, cfg.train_seq_len, n_stages)
    return ranges, stage_indices(ctx.coordinate("pp"), ctx.layout.pp, d.pp_schedule)


def make_pipeline(
    model: LanguageModel,
    cfg: Config,
    resolved: Resolved,
    device: torch.device,
    ctx: DistContext,
    ranges: list[range],
    stages: list[int],
) -> Pipeline:
    """The schedule over this process's stages, its micro-batches cut from its share."""
    d, t = cfg.dist, cfg.train
    rows = t.batch_size // ctx.dp_size
    n_micro = d.pp_microbatches or rows // t.micro_batch_size
    planned = planning()
    with outside_fake_mode():
        return build_pipeline(
            model,
            ranges,
            stages,
            schedule=d.pp_schedule,
            n_microbatches=n_micro,
            micro_batch=rows // n_micro,
            seq_len=cfg.train_seq_len,
            # what passes between stages: the residual stream, sequence-parallel under TP
            stream_len=cfg.train_seq_len // ctx.layout.tp,
            activation_dtype=resolved.precision.param_dtype,
            device=device,
            group=ctx.submesh("pp").get_group(),
            loss_sum=logits_loss_sum,
            planned=planned,
        )


def planning() -> bool:
    """Whether this build runs under the planner's FakeTensorMode."""
    return torch._C._get_dispatch_mode(torch._C._TorchDispatchModeKey.FAKE) is not None


def outside_fake_mode() -> contextlib.AbstractContextManager:
    """Leave a plan's FakeTensorMode for work on meta weights that must not be faked (device
    meshes index real tensors); a null context in a real build."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    return unset_fake_temporarily() if planning() else contextlib.nullcontext()


def reference_template(model: LanguageModel, cfg: Config) -> LanguageModel:
    """The meta model rank 0 materialises whole, as one process would: a copy of `model`, or
    under tensor or pipeline parallelism (split or pruned in `model`) the model built anew
    (checkpoint wrappers do not change the weights' names in a state dict)."""
    if cfg.dist.tp == 1 and cfg.dist.pp == 1:
        return copy.deepcopy(model)  # meta: costs no memory
    with torch.device("meta"):
        return make_model(cfg.model)


def choose_loss(
    model: LanguageModel, loss_chunk: int, kernels: LossKernels | None = None
) -> LossFn:
    """The model's loss: next-token cross-entropy (chunked through the head's weight if asked
    for), or a classifier's cross-entropy over its labels."""
    if model.is_classifier:
        if loss_chunk:
            raise ConfigError(
                "memory.loss_chunk",
                "a sequence classifier has no vocabulary-sized logits to chunk; set it to 0",
            )
        return classification_loss_sum
    if not loss_chunk:
        return token_loss_sum
    if transform := model.logit_transform:
        raise ConfigError(
            "memory.loss_chunk",
            f"the model changes its logits after the output layer ({transform} in its "
            "config.json), which the chunked loss would skip; set it to 0",
        )
    return chunked_token_loss_sum(loss_chunk, kernels)


def materialize(
    model: LanguageModel,
    device: torch.device,
    *,
    seed: int,
    dtype: torch.dtype,
    init_from: str = "",
):
    """Meta -> `device`, the model's initialisation from `seed`, weights stored in `dtype` (in
    place: keeps tied parameters tied, and works on fake tensors, where Module.to would swap
    them)."""
    torch.manual_seed(seed)
    if any(p.is_meta for p in model.parameters()):
        model.to_empty(device=device)
    model.init_weights()
    if init_from:
        load_initial_weights(model, init_from)
    for p in model.parameters():
        if p.dtype != dtype:
            p.data = p.data.to(dtype)
    return model


def load_initial_weights(model: nn.Module, path: str) -> None:
    """model.init_from: a model.safetensors in this GPT's layout (a torch or a JAX run's), over
    the initialised weights; a tied output layer may come as wte.weight or lm_head.weight.
    Fake tensors (the planner's) keep their shapes: nothing to read."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    if any(is_fake(p) for p in model.parameters()):
        return
    file = Path(path).expanduser()
    try:
        state = split_fused_qkv(load_file(str(file)))
    except (SafetensorError, OSError, ValueError) as e:
        raise ConfigError(
            "model.init_from", f"{file}: not a readable safetensors file ({e})"
        ) from None
    own = model.state_dict()
    tied = (
        {"wte.weight", "lm_head.weight"} if getattr(model.cfg, "tie_embeddings", False) else set()
    )
    if tied and not tied & state.keys():
        raise ConfigError("model.init_from", f"{file} has neither wte.weight nor lm_head.weight")
    for key in tied - state.keys():
        state[key] = state[(tied - {key}).pop()]
    wrong = sorted(k for k in own if k not in state or state[k].shape != own[k].shape)
    if wrong:
        raise ConfigError(
            "model.init_from",
            f"{file} does not hold this [model]'s {wrong[0]} "
            f"(with its shape {tuple(own[wrong[0]].shape)}): another architecture",
        )
    with torch.no_grad():
        for key, value in own.items():
            value.copy_(state[key])
