"""`model.attention auto`: the fastest exact attention for this device, dtype and shape.

On CUDA, SDPA's own dispatcher already picks the fastest fused kernel (flash, then
memory-efficient). On a CPU the fused flash kernel is not always the fastest: measured here
(2 Zen 5 cores, bf16, 16 x 4 heads x 256 x 64) flash took 24-29 ms per layer forward+backward
and the plain matmul attention with its softmax in fp32 22-41 ms, depending on the moment; for
smaller shapes plain wins. Both are exact (fp32 softmax), so
`auto` times the two once for the configured shape and caches the winner per CPU, threads, torch
version, dtype and shape.
"""

from __future__ import annotations

import statistics
import time
import warnings

import torch
import torch.nn.functional as F
from torch.nn.attention import sdpa_kernel

from onegpu.cache import cached
from onegpu.config import ConfigError, ModelConfig
from onegpu.models.gpt import SDPA_BACKENDS, plain_attention
from onegpu.perf.devices import cpu_name


def _time_fwd_bwd(fn, q, k, v, repeats: int = 5) -> float:
    times = []
    for _ in range(repeats + 1):  # the first run warms up (kernel selection, page faults)
        t0 = time.perf_counter()
        fn(q, k, v).sum().backward()
        times.append(time.perf_counter() - t0)
    return statistics.median(times[1:])


def measure_cpu_attention(shape: tuple[int, int, int, int], dtype: torch.dtype) -> str:
    """'sdpa' or 'plain', whichever runs forward+backward of causal attention faster."""
    q, k, v = (torch.randn(shape, dtype=dtype, requires_grad=True) for _ in range(3))
    sdpa = _time_fwd_bwd(
        lambda a, b, c: F.scaled_dot_product_attention(a, b, c, is_causal=True), q, k, v
    )
    plain = _time_fwd_bwd(plain_attention, q, k, v)
    return "plain" if plain < 0.9 * sdpa else "sdpa"  # near-ties go to the fused kernel


def resolve_attention(
    cfg: ModelConfig, device: torch.device, dtype: torch.dtype, batch: int
) -> str:
    """The implementation `auto` stands for here; any other setting is returned unchanged."""
    if cfg.attention != "auto":
        return cfg.attention
    if device.type != "cpu" or cfg.softmax_dtype != "float32":
        return "sdpa"
    shape = (batch, cfg.n_head, cfg.seq_len, cfg.d_model // cfg.n_head)
    key = (
        f"{cpu_name()}|threads={torch.get_num_threads()}|torch={torch.__version__}|{dtype}|{shape}"
    )
    choice = cached(
        "attention.json",
        key,
        lambda: measure_cpu_attention(shape, dtype),
        valid=lambda v: v in ("sdpa", "plain"),
    )
    return choice


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
