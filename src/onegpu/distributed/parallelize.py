"""FSDP2 and DDP over a built model, in torchtitan's order.

The build applies every single-device technique first (approximate-gradient layers,
activation checkpointing, the loss, per-block compile), then `apply_fsdp` shards each block and
then the root, and only then are the parameters materialised: each process allocates its own
shards, never the whole model (`materialize_sharded`). DDP keeps the whole model on every
process and all-reduces gradients, for models that fit one device.

Mixed precision under FSDP differs from autocast: `MixedPrecisionPolicy(param_dtype=bf16,
reduce_dtype=fp32)` casts each block's gathered parameters to bf16 once per all-gather (not per
op, in every micro-batch, as autocast does) and reduces gradients in fp32; the sharded master
weights and the optimizer stay fp32. Autocast stays on around it, so the ops it keeps in fp32
(norms, softmax, the loss) still run in fp32.

Gradients: FSDP and DDP *average* over processes. The step divides each process's summed loss
by the global batch's target count over the world size (backends/torch/step.py), so the average is the
gradient of the global mean loss: N processes x k micro-batches = 1 process x N*k.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from onegpu.distributed import compression as compressed_allreduce
from onegpu.distributed.context import DistContext
from onegpu.models.protocol import LossFn


def fsdp_mixed_precision(autocast_dtype: torch.dtype | None, param_dtype: torch.dtype):
    """bf16/fp16 gathered parameters with fp32 reduction when the weights are fp32 and autocast
    computes in 16 bits; None (FSDP's default: no casts) otherwise."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    if autocast_dtype is None or param_dtype != torch.float32:
        return None
    return MixedPrecisionPolicy(param_dtype=autocast_dtype, reduce_dtype=torch.float32)


def apply_fsdp(
    model: nn.Module,
    *,
    reshard_after_forward: bool,
    cpu_offload: bool,
    pin_memory: bool,
    mixed_precision=None,
    mesh=None,
    forward_methods: tuple[str, ...] = ("hidden",),
) -> nn.Module:
    """`fully_shard` every block, then the root (on the meta device: nothing is allocated),
    over `mesh` (None: every process; a 2-D replicate x shard mesh: HSDP).

    The root keeps its parameters gathered from forward to backward (embeddings and output
    layer are used again first thing in backward, as torchtitan does), and `hidden` is a forward
    method too, so the chunked loss, which calls `model.hidden` and then the output layer's
    weight itself, sees gathered parameters (a pipeline stage calls `stage` instead:
    `forward_methods`, so the root, gathered first, initialises FSDP)."""
    from torch.distributed.fsdp import (
        CPUOffloadPolicy,
        OffloadPolicy,
        fully_shard,
        register_fsdp_forward_method,
    )

    kwargs = {
        # pinned host memory needs an accelerator (pin_memory() fails on a CPU-only machine)
        "offload_policy": CPUOffloadPolicy(pin_memory=pin_memory)
        if cpu_offload
        else OffloadPolicy(),
    }
    if mixed_precision is not None:
        kwargs["mp_policy"] = mixed_precision
    if mesh is not None:  # the data-parallel dimensions of a larger mesh (2-D: HSDP)
        kwargs["mesh"] = mesh
    for block in model.blocks:
        fully_shard(block, reshard_after_forward=reshard_after_forward, **kwargs)
    fully_shard(model, reshard_after_forward=False, **kwargs)
    for method in forward_methods:
        register_fsdp_forward_method(model, method)
    return model


@torch.no_grad()
def materialize_sharded(
    model: nn.Module,
    device: torch.device,
    ctx: DistContext,
    reference: Callable[[], nn.Module],
    *,
    whole: bool = True,
) -> nn.Module:
    """Allocate this process's shards on `device` and fill them with exactly the weights a
    single-process run starts from: rank 0 builds and initialises the whole model on the host
    (`reference()`, the single-process initialisation: same seed, same draws), and every
    parameter is broadcast from it, each process keeping its shard. Peak device memory: the
    shards plus one parameter; the whole model exists once, in rank 0's host memory."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        set_model_state_dict,
    )

    model.to_empty(device=device)
    full = reference() if ctx.is_main else None
    set_model_state_dict(
        model,
        get_model_state_dict(full) if full is not None else {},
        # a pipeline stage (`whole` false) takes only its own modules' weights
        options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True, strict=whole),
    )
    # Buffers (rotary frequencies, ...) are not sharded and not all in the state dict.
    ref_buffers = dict(full.named_buffers()) if full is not None else {}
    for name, buf in model.named_buffers():  # (onegpu's GPT has none: no stage differs)
        src = ref_buffers[name].to(buf.device, buf.dtype) if full is not None else buf
        dist.broadcast(src, src=0)
        buf.copy_(src)
    return model


class LossModule(nn.Module):
    """The model and its loss as one forward: DDP synchronises what runs in its module's
    forward, and the (chunked) loss uses the output layer's weight outside `model.forward`."""

    def __init__(self, model: nn.Module, loss_fn: LossFn):
        super().__init__()
        self.model = model
        self.loss_fn = loss_fn

    def forward(self, idx_BT: torch.Tensor, targets_BT: torch.Tensor) -> torch.Tensor:
        return self.loss_fn(self.model, idx_BT, targets_BT)


def apply_ddp(
    model: nn.Module, loss_fn: LossFn, device: torch.device, compression: str = "none"
) -> tuple[LossFn, Callable[[], contextlib.AbstractContextManager], Any]:
    """DDP over the model and its loss, its all-reduce compressed as `compression` says
    (distributed/compression.py). Returns the loss function the step calls, the `no_sync`
    context for the micro-batches before the last (one all-reduce per step) and the
    compression hook's state to checkpoint (None: none)."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    ddp = DDP(
        LossModule(model, loss_fn),
        device_ids=[device.index] if device.type == "cuda" else None,
        gradient_as_bucket_view=True,  # gradients are views into the buckets: no second copy
        bucket_cap_mb=compressed_allreduce.bucket_cap_mb(compression, dist.get_backend()),
    )
    comm_state = compressed_allreduce.register(ddp, compression)

    def ddp_loss(_model: nn.Module, idx_BT: torch.Tensor, targets_BT: torch.Tensor):
        return ddp(idx_BT, targets_BT)

    return ddp_loss, ddp.no_sync, comm_state


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """This process's part of a (possibly sharded) tensor."""
    return t.to_local() if hasattr(t, "to_local") else t


def full_tensor(t: torch.Tensor) -> torch.Tensor:
    """The whole value of a sharded tensor (a collective); a plain tensor as it is."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t
