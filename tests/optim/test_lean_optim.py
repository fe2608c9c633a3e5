"""bf16-pure storage with Kahan-compensated optimizers, and the optimizer step inside backward."""

import pytest
import torch

from onegpu.backends.torch.build import build
from onegpu.config import OptimConfig
from onegpu.models.gpt import GPT
from onegpu.optim import build_optimizer, set_lr
from onegpu.optim.in_backward import OptimizerInBackward
from onegpu.optim.kahan import KahanAdamW, KahanSGD, kahan_add_
from onegpu.optim.state_bytes import optimizer_state_bytes
from onegpu.techniques.loss import token_loss_sum


def test_kahan_keeps_updates_that_bf16_rounds_away():
    # 1e-4 is below half a bf16 ulp of 1.0 (2**-8 / 2 = 0.002): plain bf16 never moves
    plain = torch.ones(8, dtype=torch.bfloat16)
    kahan, comp = plain.clone(), torch.zeros(8, dtype=torch.bfloat16)
    for _ in range(1000):
        plain += 1e-4
        kahan_add_(kahan, comp, torch.full((8,), 1e-4))
    assert torch.all(plain == 1.0)  # the whole 0.1 was lost
    # The compensation is itself bf16: each step rounds the residual (< half an ulp of the
    # weight, 2**-8 near 1.1) to 8 bits, an error of at most 2**-8 * 2**-9; 1000 steps bound it.
    total = kahan.float() + comp.float()
    assert torch.all((total - 1.1).abs() <= 1000 * 2**-8 * 2**-9)
    assert torch.all((kahan.float() - 1.1).abs() <= 2**-7 + 1000 * 2**-8 * 2**-9)


def test_kahan_adamw_and_sgd_match_torch_on_fp32_weights():
    """On fp32 weights the compensation is ~0, so the maths must equal torch's optimizers."""
    for ours, theirs, kw in [
        (KahanAdamW, torch.optim.AdamW, dict(lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1)),
        (KahanSGD, torch.optim.SGD, dict(lr=1e-2, momentum=0.9, weight_decay=0.1)),
    ]:
        w0 = torch.randn(16, 8)
        a, b = w0.clone().requires_grad_(), w0.clone().requires_grad_()
        opt_a, opt_b = ours([a], **kw), theirs([b], **kw)
        for step in range(20):
            g = torch.randn(16, 8, generator=torch.Generator().manual_seed(step))
            a.grad, b.grad = g.clone(), g.clone()
            opt_a.step()
            opt_b.step()
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def _steps(cfg, n=3, seed=0):
    """n training steps through the real build and step path; returns (model, grad norms)."""
    built = build(cfg, with_data=False)
    g = torch.Generator().manual_seed(seed)
    norms = []
    for i in range(n):
        x = torch.randint(0, 256, (cfg.train.batch_size, 65), generator=g)
        out = built.step(x[:, :-1], x[:, 1:], x[:, 1:].numel(), i)
        norms.append(out.grad_norm.item())
    return built, norms


def test_bf16_pure_stores_bf16_weights_and_grads_and_trains_like_fp32(tiny_cfg):
    tiny_cfg.model.dropout = 0.0
    tiny_cfg.train.precision = "bf16-pure"
    built, _ = _steps(tiny_cfg, n=1)
    model = built.model
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    x = torch.randint(0, 256, (2, 65))
    with built.policy.autocast(built.device):
        token_loss_sum(model, x[:, :-1], x[:, 1:]).backward()
    assert all(p.grad.dtype == torch.bfloat16 for p in model.parameters())
    # AdamW under bf16-pure: fp32 moments (8 bytes) + bf16 compensation (2 bytes) per parameter
    n = sum(p.numel() for p in model.parameters())
    assert optimizer_state_bytes(built.optimizer) == 10 * n

    losses = {}
    for precision in ("fp32", "bf16-pure"):
        tiny_cfg.train.precision = precision
        built = build(tiny_cfg, with_data=False)
        opt = build_optimizer(
            built.model,
            OptimConfig(lr=3e-3, warmup_steps=0),
            built.device,
            param_dtype=built.policy.param_dtype,
        )
        g = torch.Generator().manual_seed(1)
        x = torch.randint(0, 256, (8, 65), generator=g)
        for _ in range(40):
            with built.policy.autocast(built.device):
                loss = token_loss_sum(built.model, x[:, :-1], x[:, 1:]) / x[:, 1:].numel()
            loss.backward()
            opt.step()
            opt.zero_grad()
        losses[precision] = loss.item()
    assert losses["fp32"] < 4.0  # it learned (from ln(256) = 5.55)
    assert abs(losses["bf16-pure"] - losses["fp32"]) < 0.05, losses


def test_optimizer_in_backward_equals_the_ordinary_step(tiny_cfg):
    tiny_cfg.model.dropout = 0.0
    tiny_cfg.train.micro_batch_size = tiny_cfg.train.batch_size
    tiny_cfg.optim.grad_clip = 0.0
    plain, plain_norms = _steps(tiny_cfg)
    tiny_cfg.optim.in_backward = True
    fused, fused_norms = _steps(tiny_cfg)
    assert isinstance(fused.optimizer, OptimizerInBackward)
    assert all(p.grad is None for p in fused.model.parameters())  # freed right after each step
    for p, q in zip(plain.model.parameters(), fused.model.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)
    assert fused_norms == pytest.approx(plain_norms, rel=1e-5)
    # states are the same size as the ordinary optimizer's and round-trip through state_dict
    assert optimizer_state_bytes(fused.optimizer) == optimizer_state_bytes(plain.optimizer)
    fused.optimizer.load_state_dict(fused.optimizer.state_dict())


@pytest.mark.parametrize("precision", ["fp32", "bf16-pure"])
def test_optimizer_in_backward_with_accumulation_equals_the_plain_step_bit_for_bit(
    tiny_cfg, precision
):
    """Four micro-batches: the first three only accumulate, every parameter steps in the
    last one's backward on the whole batch's gradient; weights and states equal the plain
    accumulated step's exactly (the same sums in the same order, then the same update)."""
    tiny_cfg.model.dropout = 0.0
    tiny_cfg.train.precision = precision
    tiny_cfg.train.micro_batch_size = tiny_cfg.train.batch_size // 4
    tiny_cfg.optim.grad_clip = 0.0
    plain, plain_norms = _steps(tiny_cfg)
    tiny_cfg.optim.in_backward = True
    fused, fused_norms = _steps(tiny_cfg)
    assert fused.step.n_micro == 4 and isinstance(fused.optimizer, OptimizerInBackward)
    for p, q in zip(plain.model.parameters(), fused.model.parameters(), strict=True):
        assert torch.equal(p, q)
    plain_states = [s for st in plain.optimizer.state.values() for s in st.values()]
    fused_states = [s for st in fused.optimizer.state.values() for s in st.values()]
    for a, b in zip(plain_states, fused_states, strict=True):
        assert torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b
    # the plain step's norm of bf16 gradients is a bf16 number; in backward it is summed in fp32
    rel = 1e-5 if precision == "fp32" else 2**-8
    assert fused_norms == pytest.approx(plain_norms, rel=rel)
    assert all(p.grad is None for p in fused.model.parameters())  # stepped, then freed


def test_optimizer_in_backward_never_holds_all_gradients(tiny_cfg):
    tiny_cfg.train.micro_batch_size = tiny_cfg.train.batch_size
    tiny_cfg.optim.grad_clip = 0.0
    tiny_cfg.optim.in_backward = True
    built = build(tiny_cfg, with_data=False)
    params = list(built.model.parameters())
    most_alive = 0

    def count(_):
        nonlocal most_alive
        most_alive = max(most_alive, sum(p.grad is not None for p in params))

    for p in params:  # registered after the optimizer's hooks: sees the state right after them
        p.register_post_accumulate_grad_hook(count)
    x = torch.randint(0, 256, (8, 65))
    token_loss_sum(built.model, x[:, :-1], x[:, 1:]).backward()
    assert most_alive == 0


def test_set_lr_updates_tensor_learning_rates_in_place():
    model = GPT(_tiny_model_cfg())
    model.init_weights()
    opt = build_optimizer(model, OptimConfig(name="adamw8bit"), torch.device("cpu"))
    lr_tensors = [g["lr"] for g in opt.param_groups]
    set_lr(opt, 0.123)
    assert all(g["lr"] is t for g, t in zip(opt.param_groups, lr_tensors, strict=True))
    assert all(float(g["lr"]) == pytest.approx(0.123) for g in opt.param_groups)


def _tiny_model_cfg():
    from onegpu.config import load_config

    return load_config("tiny").model
