"""Precision policies: which dtype the matmuls run in, and whether the loss is scaled.

Under fp32/tf32/bf16/fp16 the weights, gradients and optimizer states stay fp32 (master
weights) and autocast runs the matmuls in bf16/fp16. fp16 needs loss scaling (its exponent range
is narrow), bf16 does not (Hugging Face, "Efficient Training on a Single GPU"). `bf16-pure` also
*stores* weights and gradients in bf16 (2 + 2 bytes per parameter instead of 4 + 4: that guide's
"model weights" rows); the optimizer
keeps fp32 moments and adds each update with Kahan compensation (optim/kahan.py) so that small
updates are not rounded away. Autocast stays on under bf16-pure so that the ops autocast keeps
in fp32 (softmax, norms, losses) still run in fp32. Note for CPUs: autocast must be asked for on
the CPU too; code that skips it there silently trains in fp32 (docs/cpu-notes.md).
"""

from __future__ import annotations

import contextlib
import dataclasses
from dataclasses import dataclass

import torch

from onegpu.config import ConfigError
from onegpu.perf.devices import cpu_peak_flops, cublas_workspace_bytes

PRECISIONS = ("fp32", "tf32", "bf16", "bf16-pure", "fp16")
CPU_BF16_MARGIN = 1.1
"""`auto` takes bf16 on a CPU only where its bf16 matmuls run this much faster than fp32 ones
(the JAX backend's rule): the rest of a bf16 step (casts, fp32 softmax and loss) costs more.
oneDNN's "supported" is not enough: it says so from AVX-512 on, BF16 instructions or not. On an
AMX Xeon with oneDNN capped at AVX512_CORE (what a Cascade Lake or Ice Lake Xeon runs) bf16
matmuls ran 0.21x its fp32 ones, capped at AVX512_CORE_BF16 (no AMX) 0.58-0.75x; an
AVX512-BF16 EPYC's run ~2x, AMX's 6x."""


@contextlib.contextmanager
def _autocast_cache_held():
    torch.autocast_increment_nesting()
    try:
        yield
    finally:
        if torch.autocast_decrement_nesting() == 0:
            torch.clear_autocast_cache()


@dataclass(frozen=True, slots=True)
class PrecisionPolicy:
    name: str
    compute_dtype: torch.dtype  # dtype of the matmuls (peak FLOPs are looked up for it)
    autocast_dtype: torch.dtype | None
    loss_scaling: bool
    param_dtype: torch.dtype = torch.float32  # dtype weights and gradients are stored in

    def autocast(self, device: torch.device) -> contextlib.AbstractContextManager:
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device.type, dtype=self.autocast_dtype)

    def casts_once(self) -> contextlib.AbstractContextManager:
        """Around a step's micro-batches: autocast's 16-bit copies of the weights are made by
        the first micro-batch and reused by the others, not made again in each. Autocast keeps
        them in a cache that it empties when its outermost region ends (after every
        micro-batch's forward); holding the region count up keeps them until the step's last
        backward. The weights do not change before the optimizer steps, so the copies and every
        result are the same, bit for bit. Autocast itself stays off in between: backward runs
        outside it, as it does without this. Eager code only: a compiled graph makes its casts
        inside itself (under `regional`, what runs outside the blocks still shares them)."""
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return _autocast_cache_held()

    def grad_scaler(
        self, device: torch.device, init_scale: float = 2.0**16
    ) -> torch.amp.GradScaler:
        """A GradScaler, enabled only for fp16 (a disabled one passes values through)."""
        return torch.amp.GradScaler(device.type, init_scale=init_scale, enabled=self.loss_scaling)


@dataclass(frozen=True, slots=True)
class DeviceCaps:
    """What a device's matmul units run natively: decides `auto` and refuses what cannot run.
    Read from the device for a run, or from the GPU table for a plan of a GPU not present."""

    type: str  # "cpu", "cuda", "mps"
    bf16: bool
    tf32: bool
    blas_workspace: int = 0
    """Bytes of each cuBLAS handle's workspace (CUDA): tensor bytes a plan does not see."""
    bf16_speedup: float | None = None
    """A CPU's bf16 matmul peak over its fp32 one; None: measured (once per machine, cached)
    when `auto` needs it. GPUs: unused (native bf16 is the faster there)."""


def bf16_native(device: torch.device) -> bool:
    """Whether bf16 matmuls run natively here, not emulated (on a CPU: whether oneDNN runs
    bf16 kernels, from AVX-512 on; not always faster than fp32 ones: auto_takes_bf16)."""
    if device.type == "cuda":
        return torch.cuda.is_bf16_supported(including_emulation=False)
    if device.type == "cpu":
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    return device.type == "mps"


def cpu_bf16_speedup() -> float:
    """This CPU's measured bf16 matmul peak over its fp32 one (perf/devices.py, cached)."""
    return cpu_peak_flops(torch.bfloat16) / cpu_peak_flops(torch.float32)


def with_bf16_speedup(caps: DeviceCaps) -> DeviceCaps:
    """`caps` with a native-bf16 CPU's speedup measured (read from the cache) where `auto`
    will weigh it, so that the decision and what reports it use one figure."""
    if caps.type != "cpu" or not caps.bf16 or caps.bf16_speedup is not None:
        return caps
    return dataclasses.replace(caps, bf16_speedup=cpu_bf16_speedup())


def precision_weighed(caps: DeviceCaps) -> dict[str, float] | None:
    """What `auto` weighed on a CPU with native bf16 (`with_bf16_speedup`'s caps), for the
    run's first line and summary.json; None where it weighed nothing."""
    if caps.type != "cpu" or caps.bf16_speedup is None:
        return None
    return {"bf16_speedup": caps.bf16_speedup, "margin": CPU_BF16_MARGIN}


def auto_takes_bf16(caps: DeviceCaps) -> bool:
    """Whether `train.precision auto` runs bf16 on the device: where it is native, and on a CPU
    only where its bf16 matmuls are CPU_BF16_MARGIN faster than fp32 ones."""
    if not caps.bf16:
        return False
    if caps.type != "cpu":
        return True
    speedup = caps.bf16_speedup if caps.bf16_speedup is not None else cpu_bf16_speedup()
    return speedup >= CPU_BF16_MARGIN


def tf32_capable(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.get_device_capability(device)[0] >= 8


def device_caps(device: torch.device) -> DeviceCaps:
    workspace = 0
    if device.type == "cuda":
        workspace = cublas_workspace_bytes(torch.cuda.get_device_capability(device))
    return DeviceCaps(device.type, bf16_native(device), tf32_capable(device), workspace)


def resolve_precision(name: str, caps: DeviceCaps | torch.device) -> PrecisionPolicy:
    """The policy for `train.precision` on this device; ConfigError if the device cannot run it."""
    if isinstance(caps, torch.device):
        caps = device_caps(caps)
    if name == "auto":
        name = "bf16" if auto_takes_bf16(caps) else "tf32" if caps.tf32 else "fp32"
    if name == "fp32":
        return PrecisionPolicy("fp32", torch.float32, None, False)
    if name == "tf32":
        if not caps.tf32:
            raise ConfigError(
                "train.precision",
                f"tf32 needs a CUDA GPU of compute capability 8.0+ (Ampere or newer), not {caps.type}; "
                "use fp32, or bf16 for speed",
            )
        return PrecisionPolicy("tf32", torch.float32, None, False)
    if name in ("bf16", "bf16-pure"):
        if caps.type == "cuda" and not caps.bf16:
            raise ConfigError(
                "train.precision",
                "this GPU has no native bf16; use fp16 (with loss scaling) or fp32",
            )
        if name == "bf16":
            return PrecisionPolicy("bf16", torch.bfloat16, torch.bfloat16, False)
        return PrecisionPolicy(
            "bf16-pure", torch.bfloat16, torch.bfloat16, False, param_dtype=torch.bfloat16
        )
    if name == "fp16":
        if caps.type == "mps":
            raise ConfigError(
                "train.precision",
                "fp16 loss scaling is not supported on mps here; use bf16 or fp32",
            )
        return PrecisionPolicy("fp16", torch.float16, torch.float16, True)
    raise ConfigError(
        "train.precision", f"unknown precision {name!r}; choose from auto, {', '.join(PRECISIONS)}"
    )


def apply_precision(policy: PrecisionPolicy, device: torch.device) -> None:
    """Process-wide matmul settings for the policy (TF32 tensor cores on or off)."""
    if device.type == "cuda":
        allow = policy.name in ("tf32", "bf16", "fp16")  # fp32 means fp32
        torch.backends.cuda.matmul.allow_tf32 = allow
        torch.backends.cudnn.allow_tf32 = allow
