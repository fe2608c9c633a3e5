"""Tensor parallelism for `--model.hf` models, from the model config's own
`base_model_tp_plan` (the plan transformers ships per architecture: which projection of a
decoder layer splits column-wise, which row-wise), applied with PyTorch's
`torch.distributed.tensor.parallel`, as for onegpu's GPT.

- the plan's `colwise` / `rowwise` layers become `ColwiseParallel` / `RowwiseParallel`: each
  process computes its own heads and its slice of the MLP, the row-wise output projections
  all-reduce their partial sums (no sequence parallelism: the plan has none, so the residual
  stream and the norms stay whole on every process);
- the embedding is split by vocabulary rows and the output layer by vocabulary columns, whose
  logits stay sharded for the vocabulary-parallel loss (or the chunked one): no process holds
  the full [tokens, vocab] logits;
- every other parameter (the norms) becomes a replicated DTensor, so clipping, the optimizer
  and Distributed Checkpoint see one kind of parameter.

An architecture without a plan, or whose plan uses a style beyond these (mixtures of experts'
`local_*`, `ep_router`, ...), is refused in one line naming it.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from onegpu.config import ConfigError

STYLES = ("colwise", "rowwise")
"""The plan styles applied; any other is refused by name."""


def hf_tp_plan(hf: nn.Module, tp: int) -> dict[str, str]:
    """The decoder's plan ({module pattern: style}), or ConfigError naming what stops it."""
    config, name = hf.config, type(hf).__name__
    plan = dict(getattr(config, "base_model_tp_plan", None) or {})
    if not plan:
        raise ConfigError(
            "dist.tp",
            f"transformers gives {name} no tensor-parallel plan (base_model_tp_plan); train "
            "it with FSDP (--dist.dp_shard) instead",
        )
    unknown = sorted({style for style in plan.values() if style not in STYLES})
    if unknown:
        raise ConfigError(
            "dist.tp",
            f"{name}'s tensor-parallel plan uses {', '.join(unknown)}, which onegpu does not "
            f"apply (only {' and '.join(STYLES)}); train it with FSDP (--dist.dp_shard)",
        )
    sizes = {
        "attention heads (num_attention_heads)": config.num_attention_heads,
        "key-value heads (num_key_value_heads)": getattr(config, "num_key_value_heads", None)
        or config.num_attention_heads,
        "MLP width (intermediate_size)": getattr(config, "intermediate_size", None) or tp,
        "vocabulary (vocab_size)": config.vocab_size,
    }
    for what, n in sizes.items():
        if n % tp:
            raise ConfigError(
                "dist.tp", f"{name}'s {n} {what} do not split over {tp} processes; use a divisor"
            )
    return plan


def apply_hf_tensor_parallel(model: Any, tp_mesh: Any) -> Any:
    """Split an `HFModel` (models/hf/adapter.py) over `tp_mesh` (1-D), in place, on the meta
    device."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    hf = model.hf
    plan = hf_tp_plan(hf, tp_mesh.size())
    styles = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}
    decoder = hf.get_decoder()
    parallelize_module(decoder, tp_mesh, {k: styles[v]() for k, v in plan.items()})
    parallelize_module(
        hf.get_input_embeddings(),
        tp_mesh,
        RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate()),
    )
    parallelize_module(
        hf.get_output_embeddings(),
        tp_mesh,
        ColwiseParallel(
            input_layouts=Replicate(), output_layouts=Shard(-1), use_local_output=False
        ),
    )
    hf.tie_weights()  # a tied output layer: the embedding's (vocabulary-sharded) weight again
    for module in hf.modules():
        _replicate_plain_parameters(module, tp_mesh)
    return model


def _replicate_plain_parameters(module: nn.Module, mesh: Any) -> None:
    """A module whose own parameters the plan left whole (a norm): each a replicated DTensor,
    its inputs made replicated DTensors and its outputs local again. Every process computes
    the same values, and their gradients agree because the column-wise layers all-reduce the
    gradient of the replicated activations they read."""
    from torch.distributed.tensor import DTensor, Replicate, distribute_module, distribute_tensor

    plain = [
        (name, p)
        for name, p in module.named_parameters(recurse=False)
        if not isinstance(p, DTensor)
    ]
    if not plain:
        return
    for name, p in plain:
        replicated = distribute_tensor(p.data, mesh, [Replicate()])
        module.register_parameter(name, nn.Parameter(replicated, p.requires_grad))

    def inputs(mod: nn.Module, args: tuple, mesh: Any) -> tuple:
        return tuple(
            DTensor.from_local(a, mesh, [Replicate()], run_check=False)
            if _is_plain_tensor(a)
            else a
            for a in args
        )

    def outputs(mod: nn.Module, out: Any, mesh: Any) -> Any:
        return out.to_local() if isinstance(out, DTensor) else out

    distribute_module(module, mesh, input_fn=inputs, output_fn=outputs)


def _is_plain_tensor(value: Any) -> bool:
    import torch
    from torch.distributed.tensor import DTensor

    return isinstance(value, torch.Tensor) and not isinstance(value, DTensor)
