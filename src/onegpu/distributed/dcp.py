"""Model and optimizer state through PyTorch Distributed Checkpoint (DCP).

Each process writes its own shards, in parallel, into one folder, and DCP's `.metadata` maps
every tensor's pieces to their place in the whole: a checkpoint written by N processes loads
into M processes (or into one, without a process group) with the shards re-cut on load. The
state dicts come from `torch.distributed.checkpoint.state_dict` (`get_state_dict`), which keys
the optimizer's states by parameter name rather than by position, so they survive re-sharding
and the change between FSDP, DDP and a single process.
"""

from __future__ import annotations

from concurrent.futures import Future
from pathlib import Path
from typing import Any

import torch
from torch import nn


def _options(flat: bool = True) -> Any:
    """Optimizer state flattened to one key per parameter (`param_groups.<name>.lr`), as
    torchtitan writes it: a pipeline stage's processes each hold other parameters, and DCP
    keeps one copy of a non-tensor value per key, so an unflattened `param_groups` list
    written by every stage would come back as one stage's list on all of them."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(flatten_optimizer_state_dict=flat)


def _state(model: nn.Module, optimizer: torch.optim.Optimizer, flat: bool = True) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_sd, optim_sd = get_state_dict(model, optimizer, options=_options(flat))
    return {"model": model_sd, "optimizer": optim_sd}


def _written_flat(folder: Path) -> bool:
    """Whether a checkpoint holds the flattened optimizer state: those written before it was
    flattened list each group's parameter names (`optimizer.param_groups.0.params...`)."""
    from torch.distributed.checkpoint import FileSystemReader

    keys = FileSystemReader(str(folder)).read_metadata().state_dict_metadata
    return not any(k.startswith("optimizer.param_groups.0.params") for k in keys)


def save(folder: Path, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Every process writes its shards of model and optimizer into `folder` (collective;
    each file is fsynced; rank 0 writes `.metadata` last, once every shard is written)."""
    import torch.distributed.checkpoint as dcp

    dcp.save(_state(model, optimizer), checkpoint_id=str(folder))


def async_save(
    folder: Path, model: nn.Module, optimizer: torch.optim.Optimizer, group: Any
) -> Future:
    """`save` whose writing happens in a background thread: this process's shards are copied
    to host memory before it returns (training may change the originals from then on); the
    future completes once every process's files and rank 0's `.metadata` are written.
    `group` must be a gloo group that nothing else uses while the future runs."""
    import torch.distributed.checkpoint as dcp

    out = dcp.async_save(_state(model, optimizer), checkpoint_id=str(folder), process_group=group)
    return out if isinstance(out, Future) else out.upload_completion


def load(folder: Path, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Load a DCP checkpoint into this model and optimizer, whatever world size wrote it."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_state_dict

    flat = _written_flat(folder)
    state = _state(model, optimizer, flat)
    dcp.load(state, checkpoint_id=str(folder))
    set_state_dict(
        model,
        optimizer,
        model_state_dict=state["model"],
        optim_state_dict=state["optimizer"],
        options=_options(flat),
    )


def load_full(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    model_sd: dict[str, torch.Tensor],
    optim_sd: dict[str, Any],
) -> None:
    """A single-process checkpoint (whole tensors; torch's position-keyed optimizer state)
    into a sharded model: positions become parameter names, then each process keeps its shard."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    full = StateDictOptions(full_state_dict=True)
    set_model_state_dict(model, model_sd, options=full)
    name_of = {id(p): name for name, p in model.named_parameters()}
    by_name: dict[str, Any] = {"state": {}, "param_groups": []}
    for saved, now in zip(optim_sd["param_groups"], optimizer.param_groups, strict=True):
        names = [name_of[id(p)] for p in now["params"]]
        if len(names) != len(saved["params"]):
            raise ValueError("the optimizer's parameter groups differ from the checkpoint's")
        for index, name in zip(saved["params"], names, strict=True):
            if index in optim_sd["state"]:
                by_name["state"][name] = optim_sd["state"][index]
        by_name["param_groups"].append({**saved, "params": names})
    set_optimizer_state_dict(model, optimizer, by_name, options=full)


def full_model_state(model: nn.Module, stages: Any = None) -> dict[str, torch.Tensor]:
    """The whole model's tensors on rank 0's host (collective; other ranks get {}). `stages`:
    the pipeline's process group, whose stages each hold part of the model: each stage's
    tensors, gathered whole within the stage, are sent to the group's first process."""
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    if stages is None:
        return get_model_state_dict(
            model, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
        )
    mine = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    mine = {k: v.detach().cpu() for k, v in mine.items()}
    parts: list[Any] = [None] * stages.size() if stages.rank() == 0 else None
    dist.gather_object(mine, parts, group_dst=0, group=stages)
    if dist.get_rank() != 0:
        return {}
    return {k: v for part in parts for k, v in part.items()}


def load_model(folder: Path, model: nn.Module) -> None:
    """Only the model's tensors of a DCP checkpoint, whole, into a model in this process (no
    process group needed): what export and generate read when a run has no model.safetensors."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

    state = {"model": get_model_state_dict(model)}
    dcp.load(state, checkpoint_id=str(folder))
    set_model_state_dict(model, state["model"])
