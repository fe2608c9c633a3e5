import math

import pytest
import torch

from onegpu.config import OptimConfig
from onegpu.models.gpt import GPT
from onegpu.optim import build_optimizer, lr_at, param_groups


def test_no_weight_decay_on_biases_norms_and_embeddings(tiny_cfg):
    for tie in (True, False):
        tiny_cfg.model.tie_embeddings = tie
        model = GPT(tiny_cfg.model)
        decay, no_decay = param_groups(model, 0.1)
        names = {id(p): n for n, p in model.named_parameters()}
        decayed = {names[id(p)] for p in decay["params"]}
        assert decayed and all(
            n.endswith(
                ("q.weight", "k.weight", "v.weight", "proj.weight", "fc.weight", "lm_head.weight")
            )
            for n in decayed
        )
        assert ("lm_head.weight" in decayed) == (not tie)  # a tied output layer is an embedding
        assert {names[id(p)] for p in no_decay["params"]} >= {
            "wte.weight",
            "wpe.weight",
            "norm_f.weight",
        }
        assert len(decay["params"]) + len(no_decay["params"]) == len(list(model.parameters()))


def test_adamw_is_fused_on_cpu(tiny_cfg):
    model = GPT(tiny_cfg.model)
    opt = build_optimizer(model, OptimConfig(), torch.device("cpu"))
    assert isinstance(opt, torch.optim.AdamW) and opt.defaults["fused"]


def test_schedules():
    cfg = OptimConfig(lr=1.0, warmup_steps=10, min_lr_ratio=0.1)
    assert lr_at(0, cfg, 110) == pytest.approx(0.1)
    assert lr_at(9, cfg, 110) == pytest.approx(1.0)
    assert lr_at(10, cfg, 110) == pytest.approx(1.0)
    assert lr_at(60, cfg, 110) == pytest.approx(0.55)  # half-way down the cosine
    assert lr_at(110, cfg, 110) == pytest.approx(0.1)
    cfg.schedule = "exp"
    assert lr_at(12, cfg, 110) == pytest.approx(0.99**2)
    cfg.schedule = "constant"
    assert lr_at(100, cfg, 110) == 1.0
    assert all(math.isfinite(lr_at(s, OptimConfig(warmup_steps=0), 5)) for s in range(5))


@pytest.mark.parametrize("name", ["adamw", "adamw8bit", "sgd", "adafactor"])
def test_each_optimizer_lowers_the_loss(name, tiny_cfg):
    from onegpu.techniques.loss import token_loss_sum

    model = GPT(tiny_cfg.model)
    model.init_weights()
    lr = {"adamw": 3e-3, "adamw8bit": 3e-3, "sgd": 0.3, "adafactor": 1e-2}[name]
    opt = build_optimizer(model, OptimConfig(name=name, lr=lr), torch.device("cpu"))
    x = torch.randint(0, 256, (4, 64))
    losses = []
    for _ in range(15):
        loss = token_loss_sum(model, x, x.roll(-1, 1)) / x.numel()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 0.5, losses


def test_state_bytes_of_lean_optimizers(tiny_cfg):
    """AdamW keeps 8 bytes per parameter; 8-bit AdamW ~2 (+ fp32 states of tensors too small
    to quantize), Adafactor a row and a column per matrix, SGD with momentum 4."""
    from onegpu.optim.state_bytes import optimizer_state_bytes

    per_param = {}
    for name in ("adamw", "adamw8bit", "adafactor", "sgd"):
        model = GPT(tiny_cfg.model)
        model.init_weights()
        opt = build_optimizer(model, OptimConfig(name=name), torch.device("cpu"))
        model(torch.randint(0, 256, (2, 16))).square().mean().backward()
        opt.step()
        per_param[name] = optimizer_state_bytes(opt) / sum(p.numel() for p in model.parameters())
    assert per_param["adamw"] == pytest.approx(8.0, abs=0.01)
    assert per_param["sgd"] == pytest.approx(4.0, abs=0.01)
    assert 2.0 <= per_param["adamw8bit"] < 8.0 / 3  # >3x less than AdamW
    assert per_param["adafactor"] < 8.0 / 20
