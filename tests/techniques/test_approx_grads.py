"""Seed 004's approximate gradients: few-bit GELU and randomized linear backward."""

import pytest
import torch
import torch.nn.functional as F

from onegpu.backends.torch.build import build
from onegpu.config import load_config
from onegpu.memory.saved import SavedTensorCounter
from onegpu.techniques.approx_grads import FewBitGELU, RandomizedLinear, pack_bits, unpack_bits


@pytest.mark.parametrize("bits", [1, 2, 3, 4])
def test_bit_packing_round_trips(bits):
    codes = torch.randint(0, 2**bits, (1003,))
    packed = pack_bits(codes, bits)
    assert packed.dtype == torch.uint8 and packed.numel() == 126 * bits  # ceil(1003 / 8) * bits
    assert torch.equal(unpack_bits(packed, bits, 1003), codes)


@pytest.mark.parametrize("bits", [1, 2, 3, 4])
def test_few_bit_gelu_saves_k_bits_and_meets_its_error_bound(bits):
    x = torch.randn(64, 256, requires_grad=True)
    g = torch.randn(64, 256)
    gelu = FewBitGELU(bits)
    with SavedTensorCounter() as counter:
        y = gelu(x)
    y.backward(g)
    levels_bytes = 4 * 2**bits  # the shared table of derivative values
    assert counter.bytes - levels_bytes == x.numel() * bits // 8  # k bits per element, counted
    x_ref = x.detach().clone().requires_grad_(True)
    y_ref = F.gelu(x_ref, approximate="tanh")
    y_ref.backward(g)
    assert torch.equal(y, y_ref)  # forward is exact
    err = (x.grad - x_ref.grad).abs()
    assert torch.all(err <= g.abs() * gelu.max_derivative_error + 1e-6)  # |dL/dy| * sup|f' - q|


def test_few_bit_gelu_error_falls_with_more_bits():
    x = torch.randn(100_000, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_(True)
    F.gelu(x_ref, approximate="tanh").sum().backward()
    errors = []
    for bits in (1, 2, 3, 4):
        x.grad = None
        FewBitGELU(bits)(x).sum().backward()
        errors.append((x.grad - x_ref.grad).pow(2).mean().sqrt().item())
    assert errors == sorted(errors, reverse=True) and errors[-1] < 0.03


def test_randomized_linear_is_unbiased():
    torch.manual_seed(0)
    lin = torch.nn.Linear(16, 8)
    x = torch.randn(64, 16)
    g = torch.randn(64, 8)
    lin(x).backward(g)
    exact_w, exact_b = lin.weight.grad.clone(), lin.bias.grad.clone()
    rlin = torch.nn.Linear(16, 8)
    rlin.load_state_dict(lin.state_dict())
    rlin.__class__, rlin.keep = RandomizedLinear, 0.25
    xr = x.clone().requires_grad_(True)
    n, mean = 2000, torch.zeros_like(exact_w)
    single_err = None
    for i in range(n):
        rlin.weight.grad = rlin.bias.grad = xr.grad = None
        rlin(xr).backward(g)
        mean += rlin.weight.grad / n
        if i == 0:
            single_err = ((rlin.weight.grad - exact_w).norm() / exact_w.norm()).item()
            torch.testing.assert_close(rlin.bias.grad, exact_b)  # bias and input grads are exact
            torch.testing.assert_close(xr.grad, g @ lin.weight)
    mean_err = ((mean - exact_w).norm() / exact_w.norm()).item()
    assert mean_err < single_err / 10  # the average converges to the exact gradient (~1/sqrt(n))
    assert mean_err < 0.1


def _saved_bytes(**mem):
    over = {
        "train.device": "cpu",
        "train.precision": "fp32",
        **{f"memory.{k}": str(v) for k, v in mem.items()},
    }
    built = build(load_config("tiny", overrides=over), torch.device("cpu"), with_data=False)
    x = torch.randint(0, 256, (4, 64))
    with SavedTensorCounter(built.model) as c:
        loss = built.loss_fn(built.model, x, x)
    loss.backward()
    assert all(p.grad is not None for p in built.model.parameters())
    return c.bytes


def test_approximate_layers_save_memory_in_the_model_and_compose():
    plain = _saved_bytes()
    gelu = _saved_bytes(gelu_bits=2)
    rand = _saved_bytes(randomized_linear=0.25)
    both = _saved_bytes(gelu_bits=2, randomized_linear=0.25)
    assert both < gelu < plain and both < rand < plain
    assert _saved_bytes(gelu_bits=2, checkpointing="attn+mlp") > 0  # composes with checkpointing


def test_tiny_trains_with_approximate_gradients(tmp_path):
    from onegpu.train import train

    over = {
        "train.device": "cpu",
        "train.max_steps": "30",
        "train.eval_every": "0",
        "out.progress": "false",
        "out.dir": str(tmp_path / "r"),
        "memory.gelu_bits": "2",
        "memory.randomized_linear": "0.5",
    }
    s = train(load_config("tiny", overrides=over))
    assert s["loss"] < 4.0  # from ~5.5: it learns
