"""Optimizers whose states are low-rank: GaLore, APOLLO and APOLLO-Mini (pytorch-optimizer's).

GaLore (Zhao et al. 2024) keeps Adam's moments of each block matrix's gradient projected on its
top `rank` singular vectors (an SVD every `update_proj_gap` steps) and applies the projected
update back. APOLLO (Zhu et al. 2024) keeps Adam's moments of a *random* projection only to
measure how much Adam would rescale the gradient, per channel, and applies that scaling to the
raw gradient; APOLLO-Mini does it at rank 1 with one scale per tensor, SGD's memory for
AdamW's behaviour. Embeddings, the output layer, norms and biases keep full AdamW moments, as
both papers do.

What onegpu adds around the library's optimizers:

- which matrices are projected: those inside the transformer blocks whose both sides exceed
  the rank (a projection of a narrower matrix saves nothing); none at all is a config error;
- checkpoints: the library keeps a projector *object* in each parameter's state, which
  `torch.load(weights_only=True)` refuses; `state_dict` writes it as plain tensors and numbers
  and `load_state_dict` rebuilds it;
- resume: APOLLO's random matrices come from torch's global generator, whose state a resumed
  run does not have; each step draws them from a generator seeded by the step number (and the
  parameter group), and leaves the global one as it was (dropout's draws do not move).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from onegpu.config import ConfigError, OptimConfig
from onegpu.optim import packages


@dataclass(frozen=True, slots=True)
class Recipe:
    rank: int
    scale: float
    scale_type: str = "tensor"  # APOLLO's: one scale per tensor, or per channel


RECIPES = {
    "galore": Recipe(rank=128, scale=0.25),  # the GaLore paper's LLaMA settings
    "apollo": Recipe(rank=256, scale=1.0, scale_type="channel"),
    "apollo-mini": Recipe(rank=1, scale=128.0),  # the APOLLO paper's APOLLO-Mini
}


def recipe(cfg: OptimConfig) -> Recipe:
    """The method's settings with optim.rank / optim.proj_scale where given."""
    base = RECIPES[cfg.name]
    return Recipe(cfg.rank or base.rank, cfg.proj_scale or base.scale, base.scale_type)


def projected_params(model: nn.Module, rank: int) -> set[int]:
    """ids of the matrices inside the blocks that are projected: both sides above `rank`."""
    blocks = getattr(model, "blocks", None)
    if blocks is None:
        return set()
    return {id(p) for p in blocks.parameters() if p.ndim == 2 and min(p.shape) > rank}


def low_rank_groups(
    groups: list[dict], model: nn.Module, cfg: OptimConfig, seed: int
) -> list[dict]:
    """`groups` with each projected matrix in a group of its own, carrying the projection's
    settings and a seed of its own (so that optimizers of one parameter each, as in
    optim.in_backward, draw independent projections)."""
    rec = recipe(cfg)
    chosen = projected_params(model, rec.rank)
    if not chosen:
        widest = max((min(p.shape) for p in model.parameters() if p.ndim == 2), default=0)
        raise ConfigError(
            "optim.rank",
            f"{cfg.name} projects the block matrices whose both sides exceed its rank "
            f"({rec.rank}), and this model has none (no matrix has a shorter side above "
            f"{widest}); lower optim.rank below that, or choose adamw / adamw8bit",
        )
    settings = {
        "rank": rec.rank,
        "update_proj_gap": cfg.update_proj_gap,
        "scale": rec.scale,
        "projection_type": "std",
    }
    out, index = [], 0
    for group in groups:
        dense = [p for p in group["params"] if id(p) not in chosen]
        for p in group["params"]:
            if id(p) in chosen:
                index += 1
                out.append({**group, "params": [p], **settings, "projection_seed": seed + index})
        if dense:
            out.append({**group, "params": dense, "projection_seed": seed})
    return out


class _Projectors:
    """What the library's GaLore and APOLLO lack for onegpu's checkpoints and resume."""

    @torch.no_grad()
    def step(self, closure=None):
        """The library's step, one group at a time, each group's random projection drawn from
        a generator seeded by its own seed and step number (the global generator left as it
        was): a matrix gets the same projection whether its optimizer steps it with the others
        or alone (optim.in_backward, the host tier), before or after a resume."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        groups = self.param_groups
        cuda = [p.device for g in groups for p in g["params"] if p.is_cuda][:1]
        try:
            for group in groups:
                self.param_groups = [group]
                with torch.random.fork_rng(devices=cuda, device_type="cuda"):
                    torch.manual_seed(group["projection_seed"] * 1_000_003 + group.get("step", 0))
                    super().step()
        finally:
            self.param_groups = groups
        return loss

    def state_dict(self) -> dict[str, Any]:
        saved = super().state_dict()
        saved["state"] = {
            index: {k: _projector_to_dict(v) if k == "projector" else v for k, v in s.items()}
            for index, s in saved["state"].items()
        }
        return saved

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)
        for state in self.state.values():
            if isinstance(state.get("projector"), dict):
                state["projector"] = _projector_from_dict(state["projector"])


_PROJECTOR_FIELDS = ("rank", "update_proj_gap", "scale", "projection_type", "last_svd_step")


def _projector_to_dict(projector) -> dict[str, Any]:
    saved = {name: getattr(projector, name) for name in _PROJECTOR_FIELDS}
    matrix = projector.ortho_matrix
    saved["ortho_matrix"] = list(matrix) if isinstance(matrix, tuple) else matrix
    return saved


def _projector_from_dict(saved: dict[str, Any]):
    from pytorch_optimizer.optimizer.utils.galore import GaLoreProjector

    projector = GaLoreProjector(
        rank=saved["rank"],
        update_proj_gap=saved["update_proj_gap"],
        scale=saved["scale"],
        projection_type=saved["projection_type"],
    )
    matrix = saved["ortho_matrix"]
    projector.ortho_matrix = tuple(matrix) if isinstance(matrix, list) else matrix
    projector.last_svd_step = saved["last_svd_step"]
    return projector


def make_low_rank(groups: list[dict], cfg: OptimConfig) -> torch.optim.Optimizer:
    """The method's optimizer over groups made by `low_rank_groups`."""
    pytorch_optimizer = packages.pytorch_optimizer(cfg.name)
    if cfg.name == "galore":
        base, extra = pytorch_optimizer.GaLore, {}
    else:
        base, extra = pytorch_optimizer.APOLLO, {"scale_type": recipe(cfg).scale_type}
    kind = type(f"Saved{base.__name__}", (_Projectors, base), {})
    return kind(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps, **extra)


def low_rank_state_bytes(name: str, params: list[torch.Tensor], groups: list[dict]) -> int:
    """The states a step of GaLore / APOLLO creates, from the library's allocation rules:
    per projected m x n matrix, two moments of max(m, n) x rank, the rank x min(m, n)
    projection and (APOLLO) the last scaled norm, a scalar; full AdamW moments for every
    other parameter."""
    ranks = {id(g["params"][0]): g["rank"] for g in groups if "rank" in g}
    total = 0
    for p in params:
        size = p.element_size()
        if id(p) not in ranks:
            total += 2 * p.numel() * size
            continue
        rank, (m, n) = ranks[id(p)], p.shape
        total += (2 * max(m, n) * rank + min(m, n) * rank) * size
        total += size if name != "galore" else 0
    return total
