"""How a torch run's checkpoints and final weights reach the disk: one crash-safe file on one
process; on several (torchrun), every process's shards of model and optimizer through
Distributed Checkpoint into `.tmp-step-N/`, then, once all of them are on disk, rank 0 adds
`train_state.pt` and renames the folder into place (runs/checkpoints.py's all-or-nothing rule).

With `checkpoint.async_save`, the shards are copied to host memory during the call and written
by a background thread while the next steps run, as torchtitan's async checkpointing does; the
rename waits for that write, so a process killed meanwhile leaves the previous checkpoint as
the newest. The run's saver (runs/saver.py) completes one save before it starts the next.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from onegpu.backends.torch import checkpoint as ckpt
from onegpu.backends.torch.build import Built
from onegpu.backends.torch.model import make_model
from onegpu.distributed import compression, dcp
from onegpu.distributed.parallelize import local_tensor
from onegpu.runs import checkpoints
from onegpu.runs.atomic import file_mode


def weights_finite(built: Built) -> bool:
    """Checked before anything is saved (one host read per save, not per step); over every
    process's shards under torchrun."""
    params = [local_tensor(p.detach()) for p in built.model.parameters()]
    finite = bool(torch.stack([torch.isfinite(p).all() for p in params]).all())
    return not built.dist.any_true(not finite)


def write_safetensors(model: torch.nn.Module, path: Path) -> None:
    """`model`'s weights as safetensors at `path`, atomically (temporary name, rename)."""
    from safetensors.torch import save_model

    tmp = path.with_name(f"{checkpoints.TMP_PREFIX}{path.name}.{os.getpid()}")
    save_model(model, str(tmp), metadata={"format": "pt"})
    os.chmod(tmp, file_mode())  # safetensors creates 0600; the run's other files are 0644
    os.replace(tmp, path)


def async_enabled(built: Built) -> bool:
    """checkpoint.async_save resolved: 'auto' is on where the training state is on a GPU."""
    choice = built.cfg.checkpoint.async_save
    if choice == "auto":
        return built.device.type == "cuda"
    return choice == "on"


def write_checkpoint(
    built: Built, path: Path, common: dict[str, Any], *, wait: bool
) -> Callable[[], None] | None:
    """The state after `common['step']` steps at `path` (a file on one process, a folder of
    shards on several: a collective). Returns what completes a background save, if any."""
    if not built.dist.enabled:
        ckpt.save_file(path, ckpt.state_of(built, common))
        return None
    ctx = built.dist
    tmp = path.with_name(checkpoints.TMP_PREFIX + path.name)
    if ctx.is_main:
        checkpoints.remove_partial(path.parent)  # a killed save's leftovers, this one too
    ctx.barrier()
    rngs = ctx.gather(ckpt.rng_state())
    comms = ctx.gather(compression.state_dict(built.comm_state))  # PowerSGD's, per process
    state = ckpt.train_state_of(built, common, rngs, comms) if ctx.is_main else None

    def commit() -> None:
        ctx.barrier()  # every process's shards are written
        if ctx.is_main:
            checkpoints.commit_folder(path, lambda f: torch.save(state, f))
        ctx.barrier()

    if async_enabled(built):
        future = dcp.async_save(tmp, built.model, built.optimizer, group=ctx.saver)

        def complete() -> None:
            future.result()  # a failed write raises here, on the process it failed on
            commit()

        if wait:
            complete()
            return None
        return complete
    dcp.save(tmp, built.model, built.optimizer)
    commit()
    return None


def write_final_weights(built: Built, path: Path) -> None:
    """model.safetensors by rank 0: the model itself, FSDP's shards gathered into a whole
    model on rank 0's host (a collective), DDP's replica, or the host optimizer's fp32
    masters where the device keeps bf16 copies."""
    model = built.model
    full = None
    if built.dist.strategy == "fsdp" or built.dist.layout.splits_model:
        # the tensors land on rank 0's host (a pipeline's stages send theirs)
        full = dcp.full_model_state(model, built.dist.stage_group())
        if not built.dist.is_main:
            return
    elif getattr(built.optimizer, "sixteen_bit", None):  # bf16 on the device, fp32 masters
        full = built.optimizer.full_precision_state(model)
    if full is not None:
        with torch.device("meta"):
            model = make_model(built.cfg.model)
        model.to_empty(device="cpu")
        model.load_state_dict(full)
        model.tie_weights()
    if built.dist.is_main:
        write_safetensors(model, path)
