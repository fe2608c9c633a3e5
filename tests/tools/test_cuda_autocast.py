"""A GPU plan follows CUDA's autocast, not the CPU's: CUDA runs a LayerNorm (a softmax, a sum) of
a bf16 tensor on an fp32 copy, which a bf16-pure GPT saves for backward in every block."""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.nn.functional as F

from onegpu.config import load_config
from onegpu.plan import memory as plan_module
from onegpu.plan.cuda_autocast import CudaAutocastRules, autocast_rules
from onegpu.plan.memory import plan_memory
from onegpu.plan.targets import gpu_caps


def test_under_autocast_the_ops_cuda_keeps_in_fp32_run_in_fp32():
    x = torch.randn(4, 8, dtype=torch.bfloat16)
    w = torch.randn(8, 8, dtype=torch.bfloat16)
    ones = torch.ones(8, dtype=torch.bfloat16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert F.layer_norm(x, (8,), ones, ones).dtype == torch.bfloat16  # the CPU's rule
        with CudaAutocastRules() as rules:
            assert F.layer_norm(x, (8,), ones, ones).dtype == torch.float32
            assert x.softmax(-1).dtype == torch.float32
            assert x.sum().dtype == torch.float32
            assert x.softmax(-1, dtype=torch.bfloat16).dtype == torch.bfloat16  # asked for
            assert (x @ w).dtype == torch.bfloat16  # matmuls: both run them in 16 bits
            assert F.gelu(x).dtype == torch.bfloat16  # on neither list
            assert F.layer_norm(x.float(), (8,)).dtype == torch.float32
    assert rules.applied == {"layer_norm": 1, "softmax": 1, "sum": 1}
    with CudaAutocastRules():  # outside autocast nothing is cast
        assert F.layer_norm(x, (8,), ones, ones).dtype == torch.bfloat16
        assert x.sum().dtype == torch.bfloat16


def test_the_fp32_copy_is_differentiable_and_gives_the_same_gradient():
    """The copy is made above autograd, as CUDA's autocast makes it: backward goes through it."""
    x = torch.randn(4, 8, dtype=torch.bfloat16, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16), CudaAutocastRules():
        F.layer_norm(x, (8,)).square().sum().backward()
    expected = x.detach().float().requires_grad_()
    F.layer_norm(expected, (8,)).square().sum().backward()
    assert x.grad.dtype == torch.bfloat16
    torch.testing.assert_close(x.grad.float(), expected.grad.bfloat16().float())


def _cfg(precision: str):
    over = {"model.dropout": "0", "train.precision": precision, "train.batch_size": "4",
            "memory.loss_chunk": "256"}  # fmt: skip
    return load_config("tiny", overrides=over)


@pytest.fixture
def cpu_rules_on_gpu(monkeypatch):
    """A GPU plan under the CPU's autocast rules: what plans did before these."""
    monkeypatch.setattr(plan_module, "autocast_rules", lambda target: contextlib.nullcontext())


def test_a_bf16_pure_gpu_plan_holds_an_fp32_copy_of_each_layernorms_input(request):
    cfg = _cfg("bf16-pure")
    caps = gpu_caps("H100-80")
    plan = plan_memory(cfg, "cuda", caps)
    request.getfixturevalue("cpu_rules_on_gpu")
    before = plan_memory(cfg, "cuda", caps)
    tokens = cfg.train.batch_size * cfg.train_seq_len
    copies = 2 * cfg.model.n_layer * tokens * cfg.model.d_model * 4  # fp32, two norms a block
    assert plan.saved_per_micro_batch - before.saved_per_micro_batch >= copies
    assert plan.memory["peak"] - before.memory["peak"] >= copies


def test_plans_whose_norms_see_fp32_are_unchanged(request):
    """bf16 keeps fp32 weights and an fp32 residual stream: its norms never see bf16, so its
    plan is the same under both rules; a CPU plan never takes CUDA's."""
    cfg = _cfg("bf16")
    caps = gpu_caps("H100-80")
    plan = plan_memory(cfg, "cuda", caps)
    request.getfixturevalue("cpu_rules_on_gpu")
    assert plan_memory(cfg, "cuda", caps).memory == plan.memory
    assert isinstance(autocast_rules("cpu"), contextlib.nullcontext)
