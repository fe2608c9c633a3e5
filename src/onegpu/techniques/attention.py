"""`model.attention auto`: the fastest exact attention for this device, dtype and shape.

On CUDA, SDPA's own dispatcher already picks the fastest fused kernel (flash, then
memory-efficient). On a CPU the fused flash kernel is not always the fastest: its forward is
good, its backward recomputes the probabilities in small tiles. Measured on 2 Zen 4 cores
(bf16, mimalloc, forward + backward a layer): flash ~45 ms and `blocked` (models/
blocked_attention.py) ~28 ms at 16 x 6 heads x 256 x 64; flash ~52 ms and blocked ~30 ms at
8 x 4 x 512 x 64. For tiny shapes the plain matmul attention wins. All are exact (fp32 scores
and softmax), so `auto` times the candidates once for the call the run makes (its rows'
length, its process's heads, packed documents' mask), interleaved, and caches the winner per
CPU, threads, torch version, allocator, dtype, call and candidates. Near-ties go to the kernel
that keeps fewer bytes for backward.
"""

from __future__ import annotations

import functools
import statistics
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import sdpa_kernel

from onegpu.cache import peek
from onegpu.config import ConfigError, ModelConfig
from onegpu.models.blocked_attention import blocked_attention
from onegpu.models.documents import document_mask, placeholder_positions
from onegpu.models.gpt import SDPA_BACKENDS, Attention, plain_attention
from onegpu.models.hf import HFModel
from onegpu.models.protocol import LossFn
from onegpu.perf.allocator import active_allocator, run_allocator
from onegpu.perf.attention_blocks import saved_prob_bytes
from onegpu.perf.contention import follows_last_run, measured_here, timed_cached
from onegpu.perf.devices import cpu_name
from onegpu.perf.logits import block_values_per_token
from onegpu.techniques import causal_softmax_cpu
from onegpu.techniques.checkpointing import block_branch
from onegpu.techniques.compile import Candidate
from onegpu.techniques.kernel_trial import missing_compiler

ROUNDS = 5
"""Interleaved rounds per candidate (after one warm-up each); the medians are compared."""
MIN_GAIN = 0.9
"""A kernel that saves more replaces a leaner one only at 0.9x its time or less: near-ties go to
the kernel that keeps fewer bytes for backward."""
MAX_PROBS_SHARE = 0.5
"""`blocked` is a candidate only where its saved probabilities add at most half to what a
block saves anyway (T <~ 900 at head dim 64): beyond, its memory costs more than its speed."""
BY_SAVED_BYTES = ("sdpa", "blocked", "plain")
"""The candidates from the least they keep for backward to the most: SDPA its output and
log-sum-exp, blocked the 16-bit probabilities of the causal blocks, plain the full square of
fp32 scores and probabilities (~3x blocked's at model B's shape)."""


@dataclass(frozen=True, slots=True)
class AttentionCall:
    """One layer's attention as the run makes it: per process (1/tp of the heads under tensor
    parallelism), at the training rows' length, with packed documents' mask where rows hold
    several."""

    batch: int
    heads: int
    seq_len: int
    head_dim: int
    documents: bool = False

    def key(self) -> str:
        shape = (self.batch, self.heads, self.seq_len, self.head_dim)
        return f"{shape}{'|documents' if self.documents else ''}"


_KERNELS: dict[str, Callable[..., torch.Tensor]] = {
    "sdpa": lambda q, k, v, mask: F.scaled_dot_product_attention(
        q, k, v, is_causal=mask is None, attn_mask=mask
    ),
    "plain": lambda q, k, v, mask: plain_attention(q, k, v, mask_B1TT=mask),
    "blocked": blocked_attention,
}


KERNELS = 2
"""The kernels the timings ran (2: blocked's softmax as onegpu's one-pass CPU kernel,
techniques/causal_softmax_cpu.py); in the cache key, so older timings are made again."""


def _kernels(candidates: tuple[str, ...]) -> int:
    """KERNELS where blocked is timed with onegpu's kernel, else 1 (builds it only then)."""
    return KERNELS if "blocked" in candidates and causal_softmax_cpu.built() else 1


def _as_compiled(name: str) -> Callable[..., torch.Tensor]:
    """The kernel as a compiled model runs it: SDPA's fused kernel is one ATen op inside a
    graph too; the matmul attentions have their softmax, mask and casts fused by inductor."""
    if name == "sdpa":
        return _KERNELS[name]
    return torch.compile(_KERNELS[name], dynamic=False)


def _fwd_bwd_s(kernel: Callable[..., torch.Tensor], q, k, v, mask) -> float:
    t0 = time.perf_counter()
    kernel(q, k, v, mask).sum().backward()
    return time.perf_counter() - t0


def _timing_mask(call: AttentionCall) -> torch.Tensor | None:
    """None (causal) for rows of one document, else the placeholder packed rows the planner
    and the memory check use (models/documents.py): the mask, not its exact cuts, is what
    changes a kernel's speed (SDPA takes a dense mask instead of its causal path)."""
    if not call.documents:
        return None
    return document_mask(placeholder_positions("bfd", call.batch, call.seq_len))


def pick(median: dict[str, float]) -> str:
    """The leanest kernel (BY_SAVED_BYTES) unless a more saving one beats every leaner one by
    MIN_GAIN: a near-tie anywhere goes to the kernel that keeps less."""
    names = [n for n in BY_SAVED_BYTES if n in median]
    choice = names[0]
    for i, name in enumerate(names[1:], start=1):
        if median[name] < MIN_GAIN * min(median[n] for n in names[:i]):
            choice = name
    return choice


def measure_cpu_attention(
    call: AttentionCall, dtype: torch.dtype, candidates: tuple[str, ...], *, compiled: bool = False
) -> dict[str, Any]:
    """{'choice': the candidate `pick` takes, 'ms': each one's median forward + backward of
    the run's attention (one layer's, ms)}; `compiled`: each as a compiled model runs it (the
    warm-up compiles, and is not counted: the run compiles anyway)."""
    causal_softmax_cpu.register()  # blocked's softmax as the run computes it
    kernels = {name: _as_compiled(name) if compiled else _KERNELS[name] for name in candidates}
    B, H, T, K = call.batch, call.heads, call.seq_len, call.head_dim
    q, k, v = (  # laid out as the model makes them: [B, T, H, K] seen as [B, H, T, K]
        torch.randn(B, T, H, K, dtype=dtype).transpose(1, 2).requires_grad_() for _ in range(3)
    )
    mask = _timing_mask(call)
    times: dict[str, list[float]] = {name: [] for name in candidates}
    for name in candidates:  # warm-up: kernel selection, page faults, compiling
        _fwd_bwd_s(kernels[name], q, k, v, mask)
    for _ in range(ROUNDS):  # interleaved: a busy moment of a shared machine hits all alike
        for name in candidates:
            times[name].append(_fwd_bwd_s(kernels[name], q, k, v, mask))
    median = {name: statistics.median(ts) for name, ts in times.items()}
    found = {"choice": pick(median), "ms": {n: round(t * 1e3, 3) for n, t in median.items()}}
    return found | ({"compiled": True} if compiled else {})


def cpu_candidates(
    cfg: ModelConfig,
    dtype: torch.dtype = torch.bfloat16,
    *,
    seq_len: int | None = None,
    keeps_products: bool = False,
    sdpa: bool = True,
) -> tuple[str, ...]:
    """The exact kernels `auto` may pick for this model on a CPU: blocked only in bf16 or fp32,
    without dropout, and where its probabilities (at `seq_len`, the rows' length, default the
    model's) are small beside the block's other saved activations. `keeps_products`: selective
    checkpointing keeps every matmul's output, which for blocked would be its fp32 scores,
    twice the bytes of the probabilities it recomputes. `sdpa` False: SDPA's kernel cannot run
    here (sdpa_recompute_fails)."""
    names = ["sdpa", "plain"] if sdpa else ["plain"]
    if dtype not in (torch.bfloat16, torch.float32) or keeps_products:  # fp16: see validation
        return tuple(names)
    T = seq_len or cfg.seq_len
    probs_per_token = saved_prob_bytes(1, cfg.n_head, T, 1) / T
    if cfg.dropout == 0 and probs_per_token <= MAX_PROBS_SHARE * block_values_per_token(cfg):
        names.append("blocked")
    return tuple(names)


def attention_choice(
    cfg: ModelConfig,
    device: torch.device,
    dtype: torch.dtype,
    call: AttentionCall,
    *,
    keeps_products: bool = False,
    timed: bool = True,
    compiled: bool = False,
    sdpa: bool = True,
) -> tuple[str, dict[str, Any] | None]:
    """(the implementation `model.attention` stands for here, the timing it was picked by:
    `cached` True where it was read, not run; None where nothing was timed; any setting but
    `auto` is returned unchanged). `auto` is timed at `call`, cached per CPU, threads,
    torch, allocator (kernels time differently under each: docs/cpu-notes.md), dtype, call and
    candidates. Plans (`timed` False) time it too, the kernel deciding what a block saves, but
    first take what a run here chose under the allocator `onegpu train` runs with: a plan must
    follow the run's choice. `compiled`: for a run that compiles its blocks, timed as compiled
    (cached apart): inductor fuses the matmul attentions' softmax, never SDPA's kernel.
    `sdpa` False: SDPA's kernel cannot run here (sdpa_recompute_fails)."""
    if cfg.attention != "auto":
        return cfg.attention, None
    if device.type != "cpu" or cfg.softmax_dtype != "float32":
        return ("sdpa" if sdpa else "plain"), None
    candidates = cpu_candidates(
        cfg, dtype, seq_len=call.seq_len, keeps_products=keeps_products, sdpa=sdpa
    )
    if len(candidates) == 1:
        return candidates[0], None
    compiled = compiled and len(candidates) > 1 and not missing_compiler(device)

    def key(allocator: str) -> str:
        return (
            f"{cpu_name()}|threads={torch.get_num_threads()}|torch={torch.__version__}"
            f"|allocator={allocator}|{dtype}|{call.key()}|{'+'.join(candidates)}"
            + ("|compiled" if compiled else "")
            + f"|kernels={_kernels(candidates)}"
        )

    def valid(found: Any) -> bool:
        if not isinstance(found, dict) or found.get("choice") not in candidates:
            return False
        ms = found.get("ms")
        return isinstance(ms, dict) and all(isinstance(t, (int, float)) for t in ms.values())

    keys = ([key(run_allocator())] if not timed else []) + [key(active_allocator())]
    provisional = not timed and follows_last_run()
    for k in keys:
        if found := peek("attention.json", k, valid=valid, provisional=provisional):
            return found["choice"], found | {"cached": not measured_here("attention.json", k)}
    found = timed_cached(
        "attention.json",
        keys[-1],
        lambda: measure_cpu_attention(call, dtype, candidates, compiled=compiled),
        what="attention (model.attention auto)",
        valid=valid,
    )
    return found["choice"], found | {"cached": False}


def sdpa_recompute_fails(
    device: torch.device, *, tensor_parallel: bool, compiles: bool, recomputes_attention: bool
) -> bool:
    """Whether SDPA's fused kernel cannot run: on a device without graph-safe RNG (a CPU),
    torch's partitioner (2.13) wraps a recomputed RNG-tagged op (SDPA's fused CPU kernel, which
    takes a dropout argument, even at 0) to save its RNG state, and puts that state after the
    graph's opaque inputs; under tensor parallelism a DTensor's DeviceMesh is one, and the
    compiled forward fails ("expected all tensors_saved_with_vc_check to be Tensors"). So:
    tensor parallelism, compiled blocks, and checkpointing that recomputes attention."""
    return device.type != "cuda" and tensor_parallel and compiles and recomputes_attention


def check_sdpa_recompute(name: str, dropout: float, *, hf: bool = False) -> None:
    """Refuse, with the ways out, an SDPA kernel where sdpa_recompute_fails: the fused kernel
    ('flash', or 'sdpa' without dropout, which picks it on a CPU). `hf`: a Hugging Face
    model's, which has no blocked attention."""
    if name == "flash" or (name == "sdpa" and dropout == 0):
        kernels = "auto, plain or math" if hf else "auto, plain, blocked or math"
        raise ConfigError(
            "model.attention",
            f"{name!r} cannot be recomputed by compiled checkpointing under tensor "
            "parallelism on this device (torch saves its RNG state out of order); use "
            f"model.attention {kernels}, memory.checkpointing mlp, or train.compile none",
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


def use_attention(model: nn.Module, impl: str) -> None:
    """Every attention layer of our GPT on the kernel `impl`."""
    for module in model.modules():
        if isinstance(module, Attention):
            module.impl = impl


def restrict_sdpa_kernel(model: nn.Module, impl: str) -> nn.Module:
    """A Hugging Face model on the SDPA kernel `impl` ('flash', 'efficient' or 'math', else
    unchanged): transformers calls SDPA without a kernel choice, so each block's attention
    module runs its forward under `sdpa_kernel`. Set on the module, before checkpointing wraps
    it, so a checkpoint's recompute runs the same kernel as the forward."""
    if impl not in SDPA_BACKENDS or not isinstance(model, HFModel):
        return model
    for block in model.blocks:
        try:
            attention = block_branch(block, "attn")
        except ConfigError:  # no attention sub-module by a known name: the whole block
            attention = block
        attention.forward = _under_sdpa_kernel(attention.forward, SDPA_BACKENDS[impl])
    return model


def _under_sdpa_kernel(forward: Callable[..., Any], kernel) -> Callable[..., Any]:
    @functools.wraps(forward)
    def restricted(*args, **kwargs):
        with sdpa_kernel(kernel):
            return forward(*args, **kwargs)

    return restricted


def on_attention(candidate: Candidate, model: nn.Module, compiled: str, eager: str) -> Candidate:
    """A compile mode `candidate` run on the attention kernel compiled timings picked
    (`compiled`), the eager pick restored after: `train.compile auto` weighs each mode on its
    own kernel against eager on the eager one."""

    def enter() -> LossFn:
        use_attention(model, compiled)
        return candidate.enter()

    def leave() -> None:
        candidate.leave()
        use_attention(model, eager)

    return Candidate(enter, leave)
