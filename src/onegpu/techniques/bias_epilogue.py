"""On CPUs, a compiled bf16 linear adds its bias in oneDNN's GEMM epilogue instead of copying it
into the output first.

ATen's CPU `addmm` (what `nn.Linear` with a bias runs) copies the bias, broadcast to the whole
[rows, out] output, into the result, then has the GEMM accumulate onto it: one extra write and
read of the output per linear. At GPT-2 124M's 4,096 tokens that is ~680 MB a step, ~30 ms
on 2 cores that stream 22-25 GB/s; a profile of model B put it at 7.6 ms a step
(benchmarks/results/profile-kernels-B-amx-2026-12-06.md). oneDNN's linear
(`mkldnn._linear_pointwise`, the kernel inductor uses for frozen inference) takes the bias as a
vector that its epilogue adds to the fp32 accumulator before the one rounding, as ATen's sum does:
the same bits (tests/techniques/test_bias_epilogue.py).

Inductor lowers that op only for constant (frozen) weights, so `BiasInEpilogue`, a post-grad
pass, routes each bf16 CPU `addmm` with a vector bias of a compiled graph to `onegpu::linear_bias`,
an opaque op over it. The backward's products are plain `mm`s and stay as they are. Eager runs keep
ATen's `addmm`: their weights' bf16 copies come from autocast's cache, which has no Python API
for an op of our own to share.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch._inductor.custom_graph_pass import CustomGraphPass, get_hash_for_files

aten = torch.ops.aten


@functools.cache
def available() -> bool:
    """Whether this torch has oneDNN with bf16 matmuls on this CPU (AVX512-BF16, AMX): where
    ATen's bf16 `addmm` is oneDNN's too. Elsewhere bf16 is emulated and runs stay fp32."""
    return bool(torch.backends.mkldnn.is_available()) and bool(
        torch.ops.mkldnn._is_mkldnn_bf16_supported()
    )


@torch.library.custom_op("onegpu::linear_bias", mutates_args=())
def linear_bias(x_NK: torch.Tensor, w_MK: torch.Tensor, b_M: torch.Tensor) -> torch.Tensor:
    """x @ w.T + b with the bias added in oneDNN's epilogue: `addmm(b, x, w.T)` without its copy."""
    return torch.ops.mkldnn._linear_pointwise(
        x_NK.contiguous(), w_MK.contiguous(), b_M.contiguous(), "none", [], ""
    )


@linear_bias.register_fake
def _(x_NK: torch.Tensor, w_MK: torch.Tensor, b_M: torch.Tensor) -> torch.Tensor:
    return x_NK.new_empty((x_NK.shape[0], w_MK.shape[0]))


def fuses(bias: Any, x_NK: Any, w_KM: Any) -> bool:
    """Whether `addmm(bias, x, w)` runs as `linear_bias` here: bf16 on a CPU with oneDNN's bf16
    matmuls, a bias that is one value per output column, and `w` a linear's weight as `F.linear`
    passes it (an [out, in] tensor seen transposed: the op reads it without a copy)."""
    tensors = all(isinstance(t, torch.Tensor) for t in (bias, x_NK, w_KM))
    return (
        tensors
        and x_NK.device.type == "cpu"
        and x_NK.dtype == w_KM.dtype == bias.dtype == torch.bfloat16
        and x_NK.dim() == w_KM.dim() == 2
        and bias.dim() == 1
        and bias.shape[0] == w_KM.shape[1]
        and w_KM.stride() == (1, w_KM.shape[0])
        and available()
    )


class BiasInEpilogue(CustomGraphPass):
    """Inductor post-grad pass: `addmm(b, x, w.T)` -> `onegpu::linear_bias(x, w, b)` where
    `fuses` says so (plain alpha and beta).

    Any two instances are equal: torch.compile's backend compares its options, this pass among
    them, and dynamo compiles a function again for a backend it finds unequal. Regional compile
    gives each block its own `torch.compile` over the same code: were the passes unequal, every
    block would compile anew, and past dynamo's recompile limit (8) the rest would run eagerly."""

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, CustomGraphPass):
            return NotImplemented
        return type(other) is type(self)

    def __hash__(self) -> int:
        return hash(type(self))

    def __call__(self, graph: torch.fx.Graph) -> None:
        for node in list(graph.find_nodes(op="call_function", target=aten.addmm.default)):
            if len(node.args) != 3 or node.kwargs:
                continue
            bias, x, w_KM = node.args
            values = [a.meta.get("val") if isinstance(a, torch.fx.Node) else a for a in node.args]
            if not fuses(*values):
                continue
            with graph.inserting_before(node):
                w_MK = graph.call_function(aten.permute.default, (w_KM, [1, 0]))
                w_MK.meta["val"] = w_KM.meta["val"].permute(1, 0)
                fused = graph.call_function(torch.ops.onegpu.linear_bias.default, (x, w_MK, bias))
                fused.meta.update(node.meta)
            node.replace_all_uses_with(fused)
            graph.erase_node(node)

    def uuid(self) -> bytes:
        return get_hash_for_files((str(Path(__file__)),))


def runs_as(op: Callable, args: list[torch.Tensor]) -> tuple[Callable, list[torch.Tensor]]:
    """The kernel a compiled run does a product with (perf/floor.py's `runs_as`): an `addmm`
    that `fuses` as `linear_bias`, any other product as dispatched."""
    if op in (aten.addmm, aten.addmm.default) and fuses(*args):
        bias, x_NK, w_KM = args
        return linear_bias, [x_NK, w_KM.t(), bias]
    return op, args


def inductor_options(device: torch.device) -> dict[str, Any]:
    """What `torch.compile(options=...)` takes to run the pass on `device` (nothing off CPUs, or
    where oneDNN's bf16 matmuls are missing: the pass would find no addmm to change)."""
    if device.type != "cpu" or not available():
        return {}
    return {"post_grad_custom_post_pass": BiasInEpilogue()}
