"""CUDA's autocast rules, applied to a plan's fake tensors, which are CPU tensors.

A plan for a GPU runs its step under the CPU's autocast (plan/memory.py). The two agree on the
matmuls, which both run in 16 bits, but not on the ops that CUDA's autocast keeps in fp32: on
CUDA a LayerNorm, a softmax or a sum given a bf16 tensor runs on an fp32 copy of it (or returns
fp32), while the CPU's autocast leaves it in bf16. Where a step feeds such ops 16-bit tensors
(bf16-pure weights, FSDP's 16-bit gathers), the GPU saves fp32 copies the CPU never makes.
GPT-2 124M, bf16-pure, batch 8 x 1024 on an H200, with torch's LayerNorm: 4.28 GiB measured,
3.66 planned under the CPU's rules, 4.26 under these
(benchmarks/results/replan-gpu-nvidia-h200-2026-11-28-2-2026-11-29-2.md, docs/gpu-suite.md).

The rules are CUDA's own, registered for the plan's duration as kernels of the dispatcher's
AutocastCPU key, where autocast itself acts: above autograd (the fp32 copy is recorded, saved
and cast back in backward, as on the GPU), in backward and in a checkpoint's recomputation too,
and for the ops a composite one dispatches (`x.square()`'s `pow`). The op lists are torch's
(aten/src/ATen/autocast_mode.h: AT_FORALL_FP32, AT_FORALL_FP32_SET_OPT_DTYPE), each op kept
where the installed torch's CUDA autocast has a rule for it, less the ops the CPU's autocast
keeps in fp32 too and `norm`'s overloads. Not followed: CUDA's rules for ops neither list
holds (the 16-bit `mv`, `dot`, ...; the promoting `addcmul`, `index_put`, ...). The
registrations are the whole process's while a plan runs: no CPU training may run beside a GPU
plan in one process.
"""

from __future__ import annotations

import contextlib
import threading
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch._C import DispatchKey, DispatchKeySet, _ExcludeDispatchKeyGuard

FP32 = [
    "acos",
    "asin",
    "cosh",
    "erfinv",
    "exp",
    "expm1",
    "log",
    "log10",
    "log2",
    "log1p",
    "reciprocal",
    "rsqrt",
    "sinh",
    "tan",
    "pow.Tensor_Scalar",
    "pow.Tensor_Tensor",
    "pow.Scalar",
    "softplus",
    "layer_norm",
    "rms_norm",
    "native_layer_norm",
    "group_norm",
    "frobenius_norm.dim",
    "nuclear_norm",
    "nuclear_norm.dim",
    "cosine_similarity",
    "poisson_nll_loss",
    "cosine_embedding_loss",
    "nll_loss",
    "nll_loss2d",
    "hinge_embedding_loss",
    "kl_div",
    "l1_loss",
    "smooth_l1_loss",
    "huber_loss",
    "mse_loss",
    "margin_ranking_loss",
    "multilabel_margin_loss",
    "soft_margin_loss",
    "triplet_margin_loss",
    "multi_margin_loss",
    "binary_cross_entropy_with_logits",
    "dist",
    "pdist",
    "cdist",
    "renorm",
    "logsumexp",
    "upsample_nearest1d",
    "_upsample_nearest_exact1d",
    "upsample_nearest2d",
    "_upsample_nearest_exact2d",
    "upsample_nearest3d",
    "_upsample_nearest_exact3d",
    "upsample_linear1d",
    "upsample_bilinear2d",
    "_upsample_bilinear2d_aa",
    "upsample_trilinear3d",
    "upsample_bicubic2d",
    "_upsample_bicubic2d_aa",
]
"""Run in fp32: every 16-bit floating-point argument is cast to an fp32 copy first."""
FP32_OUTPUT = [
    "prod",
    "prod.dim_int",
    "prod.dim_Dimname",
    "softmax.int",
    "softmax.Dimname",
    "log_softmax.int",
    "log_softmax.Dimname",
    "cumprod",
    "cumprod.dimname",
    "cumsum",
    "cumsum.dimname",
    "linalg_vector_norm",
    "linalg_matrix_norm",
    "linalg_matrix_norm.str_ord",
    "sum",
    "sum.dim_IntList",
    "sum.dim_DimnameList",
]
"""Given no dtype, computed into fp32 (dtype=float32): a 16-bit input gives an fp32 output."""
SIXTEEN_BIT = (torch.bfloat16, torch.float16)
_NO_AUTOCAST = DispatchKeySet(DispatchKey.AutocastCPU)
_lock = threading.Lock()
_in_force: dict[str, Any] = {"users": 0}  # the registrations, while any plan uses them


def _fp32(value: Any) -> Any:
    if isinstance(value, torch.Tensor) and value.dtype in SIXTEEN_BIT:
        return value.float()
    if isinstance(value, (list, tuple)):
        cast = [_fp32(v) for v in value]
        return type(value)(cast) if any(c is not v for c, v in zip(cast, value)) else value
    return value


def _fp32_kernel(op: torch._ops.OpOverload, applied: Counter[str]) -> Callable[..., Any]:
    def kernel(*args: Any, **kwargs: Any) -> Any:
        with _ExcludeDispatchKeyGuard(_NO_AUTOCAST):
            cast = tuple(_fp32(a) for a in args)
            if any(c is not a for c, a in zip(cast, args, strict=True)):
                applied[op.__name__] += 1
            return op(*cast, **{k: _fp32(v) for k, v in kwargs.items()})

    return kernel


def _fp32_output_kernel(op: torch._ops.OpOverload, applied: Counter[str]) -> Callable[..., Any]:
    names = [a.name for a in op._schema.arguments]
    at = names.index("dtype")

    def kernel(*args: Any, **kwargs: Any) -> Any:
        with _ExcludeDispatchKeyGuard(_NO_AUTOCAST):
            sixteen = isinstance(args[0], torch.Tensor) and args[0].dtype in SIXTEEN_BIT
            given = args[at] if len(args) > at else kwargs.get("dtype")
            if sixteen and given is None:  # dtype is each overload's last argument
                args, kwargs = args[:at], {**kwargs, "dtype": torch.float32}
                applied[op.__name__] += 1
            return op(*args, **kwargs)

    return kernel


def _overload(name: str) -> torch._ops.OpOverload | None:
    """aten's `name` ('pow.Tensor_Scalar', 'exp') where this torch's CUDA autocast has a rule
    for it, unless the CPU's autocast has one too (its fp32 list: an fp32 result as well)."""
    packet, _, overload = name.partition(".")
    op = getattr(getattr(torch.ops.aten, packet, None), overload or "default", None)
    has = torch._C._dispatch_has_kernel_for_dispatch_key
    if op is None or not has(f"aten::{name}", "AutocastCUDA"):
        return None
    return None if has(f"aten::{name}", "AutocastCPU") else op


def _register(applied: Counter[str]) -> torch.library.Library:
    library = torch.library.Library("aten", "IMPL")
    try:
        for names, make in ((FP32, _fp32_kernel), (FP32_OUTPUT, _fp32_output_kernel)):
            for name in names:
                if (op := _overload(name)) is not None:
                    library.impl(name, make(op, applied), "AutocastCPU")
    except BaseException:
        library._destroy()
        raise
    return library


@contextlib.contextmanager
def cuda_autocast_rules() -> Iterator[Counter[str]]:
    """Under the CPU's autocast, what CUDA's would do to the ops it keeps in fp32; yields the
    count of casts made, by op. Uses at once (nested, or in threads) share one registration,
    removed when the last ends."""
    with _lock:
        if _in_force["users"] == 0:
            applied: Counter[str] = Counter()
            _in_force.update(applied=applied, library=_register(applied))
        _in_force["users"] += 1
    try:
        yield _in_force["applied"]
    finally:
        with _lock:
            _in_force["users"] -= 1
            if _in_force["users"] == 0:
                _in_force.pop("library")._destroy()


def autocast_rules(target: str) -> contextlib.AbstractContextManager:
    """The target's autocast rules over the CPU's: CUDA's for a GPU plan, none for a CPU's."""
    return cuda_autocast_rules() if target == "cuda" else contextlib.nullcontext()
