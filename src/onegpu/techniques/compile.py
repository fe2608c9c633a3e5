"""torch.compile, whole or regional, applied after every module change (backends/torch/model.py's order).

- 'default' / 'max-autotune': the loss function (forward, output layer and cross-entropy) is
  compiled as one graph, so inductor can fuse the loss with the logits it consumes.
- 'regional': each transformer block is compiled in place (`nn.Module.compile`). The blocks run
  the same code on same-shaped inputs, so dynamo compiles the first one and reuses the result
  for the others: compile time does not grow with depth (what `nn.scan` over layers does in JAX,
  as Lippe's "Profiling and Scaling Single-GPU Transformer Models" shows). Embeddings, final
  norm and loss stay eager.

'default' and 'regional' graphs add a CPU linear's bias in oneDNN's GEMM epilogue rather than
copying it in first (techniques/bias_epilogue.py).

Compilation is lazy: nothing is compiled until the first step runs. When `train.compile auto`
compiles, and which mode, is techniques/compile_auto.py's decision.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from onegpu.models.protocol import LossFn
from onegpu.techniques.bias_epilogue import inductor_options


def apply_compile(model: nn.Module, loss_fn: LossFn, mode: str, device: torch.device) -> LossFn:
    """Compile as `train.compile` says, for a run on `device` (the model may still be on the
    meta device); returns the loss function to call."""
    if mode == "none":
        return loss_fn
    if mode == "regional":
        for block in model.blocks:
            block.compile(options=inductor_options(device))
        return loss_fn
    if mode == "default":
        return torch.compile(loss_fn, options=inductor_options(device))
    # max-autotune: inductor's own GEMM templates may take the addmms the pass would route
    return torch.compile(loss_fn, options=autotune_options())


def release_cuda_graphs(device: torch.device) -> None:
    """On a GPU, free the CUDA graphs (and their memory pool) that a max-autotune trial recorded
    where the run takes another mode: no plan counts them. The other modes record none."""
    if device.type == "cuda":
        from torch._inductor.cudagraph_trees import reset_cudagraph_trees

        reset_cudagraph_trees()


def autotune_options() -> dict[str, Any]:
    """torch.compile's 'max-autotune' mode as options, its table of timed choices per product
    left out of the run's output (inductor writes one to stderr for each of the step's ~20
    products) unless TORCHINDUCTOR_AUTOTUNE_NUM_CHOICES_DISPLAYED asks for it."""
    options = dict(torch._inductor.list_mode_options("max-autotune"))
    if "TORCHINDUCTOR_AUTOTUNE_NUM_CHOICES_DISPLAYED" not in os.environ:
        options["autotune_num_choices_displayed"] = 0
    return options


def undo_regional(model: nn.Module) -> None:
    """The blocks eager again (`nn.Module.compile` keeps its compiled call beside the module's
    own; dropping it restores the eager call)."""
    for block in model.blocks:
        block._compiled_call_impl = None


@dataclass(frozen=True, slots=True)
class Candidate:
    """A compile mode `auto` may time: `enter` applies it to the materialised model and
    returns the loss function to call; `leave` undoes what `enter` did to the model."""

    enter: Callable[[], LossFn]
    leave: Callable[[], None] = lambda: None


def auto_candidates(
    model: nn.Module, loss_fn: LossFn, wrap: Callable[[LossFn], LossFn], device: torch.device
) -> dict[str, Candidate]:
    """The modes `auto` may time (compile_auto.AUTO_MODES and AUTOTUNE_MODE) as candidates over
    the eager `loss_fn`; `wrap` goes around whatever is called
    (activation offload's hooks stay outermost). Each is compiled once and reused: the whole
    graph's wrapper, and the blocks' compiled calls (kept when the mode is left, put back when it
    is entered again, so a trial can switch between eager and compiled, and the run can take
    the trial's compile)."""
    wholes: dict[str, LossFn] = {}

    def compiled_whole(mode: str) -> Callable[[], LossFn]:
        def enter() -> LossFn:
            if mode not in wholes:
                wholes[mode] = wrap(apply_compile(model, loss_fn, mode, device))
            return wholes[mode]

        return enter

    compiled_blocks: list[Callable] = []

    def regional() -> LossFn:
        if compiled_blocks:  # entered again: the blocks' compiled calls back, none made anew
            for block, call in zip(model.blocks, compiled_blocks, strict=True):
                block._compiled_call_impl = call
        else:
            apply_compile(model, loss_fn, "regional", device)
        return wrap(loss_fn)

    def leave_regional() -> None:
        calls = [block._compiled_call_impl for block in model.blocks]
        if all(call is not None for call in calls):
            compiled_blocks[:] = calls
        undo_regional(model)

    return {
        "default": Candidate(compiled_whole("default")),
        "regional": Candidate(regional, leave_regional),
        "max-autotune": Candidate(compiled_whole("max-autotune")),
    }
