"""`model.attention auto`: the fastest exact attention for this device, dtype and shape.

On CUDA, SDPA's own dispatcher already picks the fastest fused kernel (flash, then
memory-efficient). On a CPU the fused flash kernel is not always the fastest: its forward is
good, its backward recomputes the probabilities in small tiles. Measured on 2 Zen 4 cores
(bf16, mimalloc, forward + backward a layer): flash ~45 ms and `blocked` (models/
blocked_attention.py) ~28 ms at 16 x 6 heads x 256 x 64; flash ~52 ms and blocked ~30 ms at
8 x 4 x 512 x 64. For tiny shapes the plain matmul attention wins. All are exact (fp32 scores
and softmax), so `auto` times the candidates once for the configured shape, interleaved, and
caches the winner per CPU, threads, torch version, dtype, shape and candidates. Near-ties go
to SDPA, which saves the least.
"""

from __future__ import annotations

import statistics
import time
import warnings
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch.nn.attention import sdpa_kernel

from onegpu.cache import cached
from onegpu.config import ConfigError, ModelConfig
from onegpu.models.blocked_attention import blocked_attention
from onegpu.models.gpt import SDPA_BACKENDS, plain_attention
from onegpu.perf.attention_blocks import saved_prob_bytes
from onegpu.perf.devices import cpu_name
from onegpu.perf.logits import block_values_per_token

ROUNDS = 5
"""Interleaved rounds per candidate (after one warm-up each); the medians are compared."""
MIN_GAIN = 0.9
"""Another kernel replaces SDPA only at 0.9x its time or less: near-ties go to the fused one."""
MAX_PROBS_SHARE = 0.5
"""`blocked` is a candidate only where its saved probabilities add at most half to what a
block saves anyway (T <~ 900 at head dim 64): beyond, its memory costs more than its speed."""

_KERNELS: dict[str, Callable[..., torch.Tensor]] = {
    "sdpa": lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True),
    "plain": plain_attention,
    "blocked": blocked_attention,
}


def _fwd_bwd_s(kernel: Callable[..., torch.Tensor], q, k, v) -> float:
    t0 = time.perf_counter()
    kernel(q, k, v).sum().backward()
    return time.perf_counter() - t0


def measure_cpu_attention(
    shape: tuple[int, int, int, int], dtype: torch.dtype, candidates: tuple[str, ...]
) -> str:
    """The candidate that runs forward+backward of causal attention fastest, SDPA on a near-tie."""
    B, H, T, K = shape  # laid out as the model makes them: [B, T, H, K] seen as [B, H, T, K]
    q, k, v = (
        torch.randn(B, T, H, K, dtype=dtype).transpose(1, 2).requires_grad_() for _ in range(3)
    )
    times: dict[str, list[float]] = {name: [] for name in candidates}
    for name in candidates:  # warm-up: kernel selection, page faults
        _fwd_bwd_s(_KERNELS[name], q, k, v)
    for _ in range(ROUNDS):  # interleaved: a busy moment of a shared machine hits all alike
        for name in candidates:
            times[name].append(_fwd_bwd_s(_KERNELS[name], q, k, v))
    median = {name: statistics.median(ts) for name, ts in times.items()}
    fastest = min(median, key=median.__getitem__)
    return fastest if median[fastest] < MIN_GAIN * median["sdpa"] else "sdpa"


def cpu_candidates(
    cfg: ModelConfig, dtype: torch.dtype = torch.bfloat16, *, keeps_products: bool = False
) -> tuple[str, ...]:
    """The exact kernels `auto` may pick for this model on a CPU: blocked only in bf16 or fp32,
    without dropout, and where its probabilities are small beside the block's other saved
    activations. `keeps_products`: selective checkpointing keeps every matmul's output, which
    for blocked would be its fp32 scores, twice the bytes of the probabilities it recomputes."""
    names = ["sdpa", "plain"]
    if dtype not in (torch.bfloat16, torch.float32) or keeps_products:  # fp16: see validation
        return tuple(names)
    probs_per_token = saved_prob_bytes(1, cfg.n_head, cfg.seq_len, 1) / cfg.seq_len
    if cfg.dropout == 0 and probs_per_token <= MAX_PROBS_SHARE * block_values_per_token(cfg):
        names.append("blocked")
    return tuple(names)


def resolve_attention(
    cfg: ModelConfig,
    device: torch.device,
    dtype: torch.dtype,
    batch: int,
    *,
    keeps_products: bool = False,
) -> str:
    """The implementation `auto` stands for here; any other setting is returned unchanged."""
    if cfg.attention != "auto":
        return cfg.attention
    if device.type != "cpu" or cfg.softmax_dtype != "float32":
        return "sdpa"
    shape = (batch, cfg.n_head, cfg.seq_len, cfg.d_model // cfg.n_head)
    candidates = cpu_candidates(cfg, dtype, keeps_products=keeps_products)
    key = (
        f"{cpu_name()}|threads={torch.get_num_threads()}|torch={torch.__version__}|{dtype}|{shape}"
        f"|{'+'.join(candidates)}"
    )
    return cached(
        "attention.json",
        key,
        lambda: measure_cpu_attention(shape, dtype, candidates),
        valid=lambda v: v in candidates,
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
