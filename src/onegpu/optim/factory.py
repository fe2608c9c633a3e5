"""One small factory for the optimizers onegpu supports, with GPT-style parameter groups."""

from __future__ import annotations

import inspect

import torch
from torch import nn

from onegpu.config import ConfigError, OptimConfig


def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """Decay matrices only: not biases, norm gains or embeddings (seed 001, nanoGPT).

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


def _fused_ok(device: torch.device, params: list[torch.Tensor]) -> bool:
    if "fused" not in inspect.signature(torch.optim.AdamW).parameters:
        return False
    return device.type in ("cuda", "cpu", "mps") and all(p.is_floating_point() for p in params)


def _adamw8bit(groups: list[dict], cfg: OptimConfig) -> torch.optim.Optimizer:
    """AdamW with block-wise 8-bit moments (torchao: runs on CPU and CUDA alike)."""
    try:
        from torchao.optim import AdamW8bit
    except ImportError as e:
        raise ConfigError(
            "optim.name",
            f"adamw8bit needs torchao ({e}); pip install 'onegpu[lowbit]' or choose adamw/adafactor",
        ) from None
    return AdamW8bit(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps)


def build_optimizer(
    model: nn.Module, cfg: OptimConfig, device: torch.device
) -> torch.optim.Optimizer:
    groups = param_groups(model, cfg.weight_decay)
    params = [p for g in groups for p in g["params"]]
    if cfg.name == "adamw":
        # fused: one kernel for all parameters (CUDA and, since torch 2.4, CPU: a few percent
        # faster than foreach there, CPU-NOTES); foreach otherwise.
        fused = _fused_ok(device, params)
        return torch.optim.AdamW(
            groups,
            lr=cfg.lr,
            betas=(cfg.beta1, cfg.beta2),
            eps=cfg.eps,
            fused=fused or None,
            foreach=None if fused else True,
        )
    if cfg.name == "adamw8bit":
        return _adamw8bit(groups, cfg)
    if cfg.name == "sgd":
        return torch.optim.SGD(groups, lr=cfg.lr, momentum=cfg.beta1, foreach=True)
    if cfg.name == "adafactor":
        return torch.optim.Adafactor(groups, lr=cfg.lr, foreach=True)
    raise ValueError(f"unknown optimizer {cfg.name!r}")  # config validation prevents this
