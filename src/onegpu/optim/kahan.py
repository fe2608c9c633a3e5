"""Optimizers for bf16-stored weights: fp32 moments, Kahan-compensated updates.

A bf16 weight has 8 bits of mantissa: an update smaller than half a unit in the last place
(|w| * 2**-9) is rounded away entirely, and late in training most updates are that small. These
optimizers keep, per parameter, a bf16 compensation buffer holding what rounding dropped, and
add it back on the next step (Kahan summation; the technique of AnyPrecisionAdamW and
optimi). Weights then move as if stored with ~16 bits of mantissa, for 2 extra bytes per
parameter instead of a 4-byte fp32 master copy.

Memory per parameter under `bf16-pure`: weight 2 + gradient 2 + moments 8 (AdamW) or 4 (SGD)
+ compensation 2.
"""

from __future__ import annotations

import math

import torch


@torch.no_grad()
def kahan_add_(param: torch.Tensor, comp: torch.Tensor, update: torch.Tensor) -> None:
    """param += update (fp32) in param's dtype, carrying the rounding error in comp."""
    exact = param.to(torch.float32, copy=True).add_(comp.float()).add_(update)
    param.copy_(exact)  # rounds to bf16
    comp.copy_(exact.sub_(param.float()))  # what rounding dropped (exact in fp32)


class _KeepStateDtypes(torch.optim.Optimizer):
    """Optimizer.load_state_dict casts floating state to each parameter's dtype; these
    optimizers keep fp32 moments beside bf16 weights by design, so restore the saved dtypes
    (a resumed run must continue bit for bit)."""

    def load_state_dict(self, state_dict: dict) -> None:
        super().load_state_dict(state_dict)
        params = [p for group in self.param_groups for p in group["params"]]
        for index, saved in state_dict["state"].items():
            state = self.state[params[index]]
            for key, value in saved.items():
                if isinstance(value, torch.Tensor) and value.is_floating_point():
                    state[key] = value.to(device=params[index].device, copy=True)


class KahanAdamW(_KeepStateDtypes):
    """AdamW (decoupled weight decay, bias correction) with fp32 moments and Kahan updates."""

    def __init__(
        self,
        params,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
    ):
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
        super().__init__(params, defaults)

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            lr, (b1, b2), eps, wd = group["lr"], group["betas"], group["eps"], group["weight_decay"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["step"] = 0
                    state["exp_avg"] = torch.zeros_like(p, dtype=torch.float32)
                    state["exp_avg_sq"] = torch.zeros_like(p, dtype=torch.float32)
                    state["compensation"] = torch.zeros_like(p)
                state["step"] += 1
                t = state["step"]
                g = p.grad.float()
                m, v = state["exp_avg"], state["exp_avg_sq"]
                m.lerp_(g, 1 - b1)
                v.mul_(b2).addcmul_(g, g, value=1 - b2)
                denom = v.sqrt().div_(math.sqrt(1 - b2**t)).add_(eps)
                update = m.div(denom).mul_(-lr / (1 - b1**t))
                if wd:
                    update.add_(p.float(), alpha=-lr * wd)
                kahan_add_(p, state["compensation"], update)
        return loss


class KahanSGD(_KeepStateDtypes):
    """SGD with momentum (torch.optim.SGD's semantics: L2 weight decay folded into the
    gradient, no dampening) with an fp32 momentum buffer and Kahan updates."""

    def __init__(self, params, lr: float = 1e-3, momentum: float = 0.0, weight_decay: float = 0.0):
        super().__init__(params, dict(lr=lr, momentum=momentum, weight_decay=weight_decay))

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            lr, mu, wd = group["lr"], group["momentum"], group["weight_decay"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                g = p.grad.to(torch.float32, copy=True)
                if wd:
                    g.add_(p.float(), alpha=wd)
                if mu:
                    if "momentum_buffer" not in state:
                        state["momentum_buffer"] = g.clone()
                    else:
                        state["momentum_buffer"].mul_(mu).add_(g)
                    g = state["momentum_buffer"]
                if "compensation" not in state:
                    state["compensation"] = torch.zeros_like(p)
                kahan_add_(p, state["compensation"], g.mul(-lr))
        return loss
