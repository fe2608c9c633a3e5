"""Adam-mini (Zhang et al. 2024; pytorch-optimizer's): Adam's first moment, but one second
moment per block of parameters instead of one per parameter, about half of AdamW's state.

The blocks follow the Hessian's structure the paper found: embeddings and the output layer keep
a second moment per parameter, the query and key projections one per attention head, every
other tensor one in all. The library tells these apart by parameter *names* of a few model
families; onegpu names each parameter's role instead (from the module it belongs to, so the
GPT here and any transformers model are read alike) and hands the library its groups.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from onegpu.config import OptimConfig
from onegpu.optim import packages

QUERY_KEY = {"q": "q_proj.weight", "k": "k_proj.weight"}  # the names the library looks for


def _role(name: str, p: torch.Tensor, embeddings: set[int]) -> str:
    """'embed', 'q_proj.weight', 'k_proj.weight' or 'other': the library's routing names."""
    if id(p) in embeddings or name.endswith(("lm_head.weight", "output.weight")):
        return "embed"
    last = name.rsplit(".", 2)[-2:] if p.ndim == 2 else []
    if len(last) == 2 and last[1] == "weight":
        head = last[0].removesuffix("_proj").removeprefix("w")
        if head in QUERY_KEY:
            return QUERY_KEY[head]
    return "other"


def adam_mini_groups(groups: list[dict], model: nn.Module) -> list[dict]:
    """`groups` split one parameter a group, each named by its role (with the parameters per
    head of the query and key projections, and the model's width and heads for the step)."""
    cfg = model.cfg
    embeddings = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    names = {id(p): n for n, p in model.named_parameters()}
    per_head = cfg.d_model * cfg.d_model // cfg.n_head
    out = []
    for group in groups:
        for p in group["params"]:
            role = _role(names[id(p)], p, embeddings)
            extra = {"parameter_per_head": per_head} if role in QUERY_KEY.values() else {}
            out.append(
                {
                    **group,
                    "params": [p],
                    "name": role,
                    **extra,
                    "num_embeds": cfg.d_model,
                    "num_heads": cfg.n_head,
                }
            )
    return out


def make_adam_mini(groups: list[dict], cfg: OptimConfig) -> torch.optim.Optimizer:
    """The library's AdamMini over groups made by `adam_mini_groups`."""
    AdamMini = packages.pytorch_optimizer(cfg.name).AdamMini

    class GivenGroups(AdamMini):
        def get_optimizer_groups(self, weight_decay: float) -> list[dict[str, Any]]:
            return groups

    return GivenGroups(
        nn.Module(),  # the library reads names from a model; the groups carry them instead
        lr=cfg.lr,
        betas=(cfg.beta1, cfg.beta2),
        eps=cfg.eps,
        num_embeds=groups[0]["num_embeds"],
        num_heads=groups[0]["num_heads"],
    )


def adam_mini_state_bytes(groups: list[dict]) -> int:
    """What the library's step allocates (all fp32): embeddings and the output layer two
    moments per parameter; the query and key projections a first moment and a second per
    head; every other tensor a first moment, one second moment and its size, as tensors."""
    total = 0
    for group in groups:
        (p,) = group["params"]
        if group["name"] == "embed":
            total += 8 * p.numel()
        elif "parameter_per_head" in group:
            total += 4 * p.numel() + 4 * (p.numel() // group["parameter_per_head"])
        else:
            total += 4 * p.numel() + 4 + 4
    return total
