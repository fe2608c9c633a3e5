"""One small factory for the optimizers onegpu supports, with GPT-style parameter groups."""

from __future__ import annotations

import inspect

import torch
from torch import nn

from onegpu.config import LOW_RANK_OPTIMIZERS, ConfigError, OptimConfig
from onegpu.offload.disk_tier import DiskTier
from onegpu.offload.host_optimizer import HostOffloadOptimizer
from onegpu.offload.host_states import HostStates
from onegpu.optim import packages
from onegpu.optim.adam_mini import adam_mini_groups, adam_mini_state_bytes, make_adam_mini
from onegpu.optim.in_backward import (
    ELEMENTWISE,
    OneParameterAtATime,
    OptimizerInBackward,
    PerParameterOptimizers,
)
from onegpu.optim.kahan import KahanAdamW, KahanSGD
from onegpu.optim.low_rank import low_rank_groups, low_rank_state_bytes, make_low_rank
from onegpu.optim.state_bytes import predicted_state_bytes, step_transient_bytes
from onegpu.quiet import library_notes_off

STAND_IN = "plan-stand-in"  # a fake build's optimizer name: plan-stand-in:<the real one's>


class StandIn(torch.optim.SGD):
    """The optimizer a fake build steps for one whose step cannot run on fake tensors: bare
    SGD, stateless (under bf16-pure too, where onegpu's SGD is Kahan-compensated and would add
    its buffers to the plan), holding during its step the bytes the real step holds at once
    beyond its states (optim/state_bytes.py, which also counts the states by rule)."""

    def __init__(self, groups: list[dict], lr: float, transient_bytes: int):
        # no weight decay: SGD's would copy every gradient, which the real step does not
        super().__init__([{**g, "weight_decay": 0.0} for g in groups], lr=lr, foreach=True)
        self.transient_bytes = transient_bytes

    @torch.no_grad()
    def step(self, closure=None):
        device = self.param_groups[0]["params"][0].device
        held = torch.empty(self.transient_bytes, dtype=torch.uint8, device=device)
        out = super().step(closure)
        del held
        return out


def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """Decay matrices only: not biases, norm gains or embeddings (as nanoGPT and Hugging Face's
    "Efficient Training on a Single GPU" do).

    A tied embedding/output weight is an embedding: it is not decayed.
    """
    embedding_params = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    decay, no_decay, seen = [], [], set()
    for p in model.parameters():
        if not p.requires_grad or id(p) in seen:
            continue
        seen.add(id(p))
        (decay if p.ndim >= 2 and id(p) not in embedding_params else no_decay).append(p)
    return [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]


def matmul_weights(model: nn.Module, keep_head: bool = False) -> frozenset[int]:
    """ids of the weights autocast casts for its matmuls (nn.Linear's), but not an embedding
    tied to an output layer (its lookup would return bf16), nor with `keep_head` the output
    layer (the chunked loss sums its gradient in fp32)."""
    keep = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    head = getattr(model, "lm_head", None)
    if keep_head and head is not None:
        keep.add(id(head.weight))
    linear = {id(m.weight) for m in model.modules() if isinstance(m, nn.Linear)}
    return frozenset(linear - keep)


def optimizer_groups(model: nn.Module, cfg: OptimConfig, seed: int = 0) -> list[dict]:
    """The parameter groups the configured optimizer steps: decay or not, and for GaLore,
    APOLLO and Adam-mini a group per parameter with what the method needs to know of it."""
    groups = param_groups(model, cfg.weight_decay)
    if cfg.name in LOW_RANK_OPTIMIZERS:  # each projected matrix in a group of its own
        return low_rank_groups(groups, model, cfg, seed)
    if cfg.name == "adam-mini":
        return adam_mini_groups(groups, model)
    return groups


def rule_state_bytes(model: nn.Module, cfg: OptimConfig) -> int:
    """State bytes of optimizers whose step cannot run on the planner's fake tensors, from
    their own allocation rules (checked against the real ones in the tests)."""
    params = list({id(p): p for p in model.parameters()}.values())
    return _rule_bytes(cfg.name, params, optimizer_groups(model, cfg))


def _rule_bytes(name: str, params: list[torch.Tensor], groups: list[dict]) -> int:
    if name in LOW_RANK_OPTIMIZERS:
        return low_rank_state_bytes(name, params, groups)
    if name == "adam-mini":
        return adam_mini_state_bytes(groups)
    return predicted_state_bytes(name, params)


def _fused_ok(device: torch.device, params: list[torch.Tensor]) -> bool:
    if "fused" not in inspect.signature(torch.optim.AdamW).parameters:
        return False
    return device.type in ("cuda", "cpu", "mps") and all(p.is_floating_point() for p in params)


def _low_bit_adamw(
    groups: list[dict], cfg: OptimConfig, *, stochastic_round: bool = False
) -> torch.optim.Optimizer:
    """AdamW with block-wise 8- or 4-bit moments (torchao: runs on CPU and CUDA alike). For
    bf16 weights the update is rounded stochastically (unbiased), torchao's Kahan."""
    library_notes_off()
    try:
        from torchao.optim import AdamW4bit, AdamW8bit
    except ImportError as e:
        raise ConfigError(
            "optim.name",
            f"{cfg.name} needs torchao ({e}); pip install 'onegpu[lowbit]' or choose adamw",
        ) from None
    return (AdamW8bit if cfg.name == "adamw8bit" else AdamW4bit)(
        groups,
        lr=cfg.lr,
        betas=(cfg.beta1, cfg.beta2),
        eps=cfg.eps,
        bf16_stochastic_round=stochastic_round,
    )


def _trust_ratio(groups: list[dict], cfg: OptimConfig) -> torch.optim.Optimizer:
    """LAMB (Adam's update scaled per tensor by |w| / |update|) or LARS (momentum SGD scaled
    the same way), pytorch-optimizer's: the large-batch optimizers of the memory survey."""
    pytorch_optimizer = packages.pytorch_optimizer(cfg.name)
    if cfg.name == "lamb":
        return pytorch_optimizer.Lamb(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps)
    return pytorch_optimizer.LARS(groups, lr=cfg.lr, momentum=cfg.beta1)


def build_optimizer(
    model: nn.Module,
    cfg: OptimConfig,
    device: torch.device,
    *,
    param_dtype: torch.dtype = torch.float32,
    offload: bool = False,
    offload_dir: str = "",
    states_on_host: bool = False,
    sixteen_bit_weights: bool = False,
    keep_head: bool = False,
    fake: bool = False,
    seed: int = 0,
) -> torch.optim.Optimizer | PerParameterOptimizers | HostOffloadOptimizer:
    """The configured optimizer for weights stored in `param_dtype` (the precision policy's);
    stepped inside backward, per parameter, if optim.in_backward; on host copies of the
    weights, stepped on the CPU, if `offload` (memory.offload_optimizer), their copies and
    states in files under `offload_dir` if given (none made on a `fake` build: a plan); with
    its states in host memory, each parameter stepped alone on the device, if
    `states_on_host` (memory.offload_states). `sixteen_bit_weights` (bf16 autocast with the
    optimizer on the host): the matmul weights in bf16 on the device, fp32 masters on the host
    (`keep_head`: not the output layer's).
    `seed`: the run's, from which low-rank optimizers draw their random projections."""
    groups = optimizer_groups(model, cfg, seed)
    if states_on_host:
        make = lambda gs: _make(gs, cfg, device, param_dtype, states_on_host=True)  # noqa: E731
        kind = OptimizerInBackward if cfg.in_backward else OneParameterAtATime
        states = HostStates(device, across_steps=cfg.in_backward)
        return kind(groups, make, states=states, slice_block=_slice_block(cfg))
    if offload:
        cpu = torch.device("cpu")
        make = lambda gs: _make(gs, cfg, cpu, param_dtype)  # noqa: E731
        if cfg.in_backward:  # one per host copy, stepped as its gradient lands
            per_param, block = make, _slice_block(cfg)
            make = lambda gs: PerParameterOptimizers(gs, per_param, slice_block=block)  # noqa: E731
        disk = DiskTier(offload_dir) if offload_dir and not fake else None
        return HostOffloadOptimizer(
            groups,
            make,
            device,
            list(model.parameters()),
            disk=disk,
            on_disk=bool(offload_dir),
            sixteen_bit=matmul_weights(model, keep_head) if sixteen_bit_weights else frozenset(),
        )
    if cfg.in_backward:
        make = lambda gs: _make(gs, cfg, device, param_dtype)  # noqa: E731
        return OptimizerInBackward(groups, make, slice_block=_slice_block(cfg))
    return _make(groups, cfg, device, param_dtype)


def _slice_block(cfg: OptimConfig) -> int | None:
    """An elementwise optimizer's state block: large parameters step in slices of it (a
    plan's stand-in as the optimizer it stands in for)."""
    name = cfg.name.partition(":")[2] if cfg.name.startswith(STAND_IN) else cfg.name
    return ELEMENTWISE.get(name)


def _make(
    groups: list[dict],
    cfg: OptimConfig,
    device: torch.device,
    param_dtype: torch.dtype,
    *,
    states_on_host: bool = False,
) -> torch.optim.Optimizer:
    params = [p for g in groups for p in g["params"]]
    if cfg.name.startswith(STAND_IN):  # a plan's step of an optimizer fake tensors cannot run
        real = cfg.name.partition(":")[2]
        held = step_transient_bytes(real, params)
        if states_on_host:  # the states it steps are brought to the device for the step
            held += _rule_bytes(real, params, groups)
        return StandIn(groups, cfg.lr, held)
    if param_dtype == torch.bfloat16:
        return _make_for_bf16_weights(groups, cfg)
    if cfg.name == "adamw":
        # fused: one kernel for all parameters (CUDA and, since torch 2.4, CPU: a few percent
        # faster than foreach there, docs/cpu-notes.md); foreach otherwise.
        fused = _fused_ok(device, params)
        return torch.optim.AdamW(
            groups,
            lr=cfg.lr,
            betas=(cfg.beta1, cfg.beta2),
            eps=cfg.eps,
            fused=fused or None,
            foreach=None if fused else True,
        )
    if cfg.name in ("adamw8bit", "adamw4bit"):
        return _low_bit_adamw(groups, cfg)
    if cfg.name in ("lamb", "lars"):
        return _trust_ratio(groups, cfg)
    if cfg.name == "sgd":
        return torch.optim.SGD(groups, lr=cfg.lr, momentum=cfg.beta1, foreach=True)
    if cfg.name == "adafactor":
        return torch.optim.Adafactor(groups, lr=cfg.lr, foreach=True)
    if cfg.name in LOW_RANK_OPTIMIZERS:
        return make_low_rank(groups, cfg)
    if cfg.name == "adam-mini":
        return make_adam_mini(groups, cfg)
    raise ValueError(f"unknown optimizer {cfg.name!r}")  # config validation prevents this


def _make_for_bf16_weights(groups: list[dict], cfg: OptimConfig) -> torch.optim.Optimizer:
    """bf16-pure: updates must not be rounded away in bf16 (Kahan or stochastic rounding)."""
    if cfg.name == "adamw":
        return KahanAdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps)
    if cfg.name == "sgd":
        return KahanSGD(groups, lr=cfg.lr, momentum=cfg.beta1)
    if cfg.name in ("adamw8bit", "adamw4bit"):
        return _low_bit_adamw(groups, cfg, stochastic_round=True)
    # config validation refuses adafactor with bf16-pure
    raise ValueError(f"{cfg.name} has no bf16-weight variant")
