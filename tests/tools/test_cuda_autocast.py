"""A GPU plan follows CUDA's autocast, not the CPU's: CUDA runs a LayerNorm (a softmax, a sum) of
a bf16 tensor on an fp32 copy, which a bf16-pure model with torch's LayerNorm saves for backward
in every block."""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.nn.functional as F
from conftest import hf_overrides
from torch import nn
from torch.utils.checkpoint import checkpoint

from onegpu.config import load_config
from onegpu.models import gpt
from onegpu.plan import memory as plan_module
from onegpu.plan.cuda_autocast import autocast_rules, cuda_autocast_rules
from onegpu.plan.memory import plan_memory
from onegpu.plan.report import plan_report
from onegpu.plan.targets import gpu_caps


def test_under_autocast_the_ops_cuda_keeps_in_fp32_run_in_fp32():
    x = torch.randn(4, 8, dtype=torch.bfloat16)
    w = torch.randn(8, 8, dtype=torch.bfloat16)
    ones = torch.ones(8, dtype=torch.bfloat16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert F.layer_norm(x, (8,), ones, ones).dtype == torch.bfloat16  # the CPU's rule
        with cuda_autocast_rules() as applied:
            assert F.layer_norm(x, (8,), ones, ones).dtype == torch.float32
            assert x.softmax(-1).dtype == torch.float32
            assert x.sum().dtype == torch.float32
            assert (x**2).dtype == torch.float32
            assert x.softmax(-1, dtype=torch.bfloat16).dtype == torch.bfloat16  # asked for
            assert x.softmax(-1, torch.bfloat16).dtype == torch.bfloat16  # positionally too
            assert (x @ w).dtype == torch.bfloat16  # matmuls: both run them in 16 bits
            assert F.gelu(x).dtype == torch.bfloat16  # on neither list
            assert F.layer_norm(x.float(), (8,)).dtype == torch.float32
        assert F.layer_norm(x, (8,), ones, ones).dtype == torch.bfloat16  # unregistered after
    assert applied == {
        "layer_norm.default": 1,
        "softmax.int": 1,
        "sum.default": 1,
        "pow.Tensor_Scalar": 1,
    }
    with cuda_autocast_rules():  # outside autocast nothing is cast
        assert F.layer_norm(x, (8,), ones, ones).dtype == torch.bfloat16
        assert x.sum().dtype == torch.bfloat16


def test_the_rules_are_the_installed_torchs_and_nested_uses_share_them():
    """An op is followed where this torch's CUDA autocast has a rule for it (RMSNorm's is newer
    than torch 2.11), and a nested use leaves the rules in force for the outer one."""
    x = torch.randn(4, 8, dtype=torch.bfloat16)
    cuda_has = torch._C._dispatch_has_kernel_for_dispatch_key("aten::rms_norm", "AutocastCUDA")
    with cuda_autocast_rules() as outer, torch.autocast("cpu", dtype=torch.bfloat16):
        with cuda_autocast_rules() as inner:
            expected = torch.float32 if cuda_has else torch.bfloat16
            assert F.rms_norm(x, (8,)).dtype == expected
        assert inner is outer
        assert F.layer_norm(x, (8,)).dtype == torch.float32  # still in force
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert F.layer_norm(x, (8,)).dtype == torch.bfloat16  # gone with the last use


def test_the_fp32_copy_is_recorded_and_recomputed_as_cudas():
    """The copy is made above autograd, as CUDA's autocast makes it: backward goes through it,
    and a checkpoint's recomputation (in backward) makes it again, with the same dtypes."""
    x = torch.randn(4, 8, dtype=torch.bfloat16, requires_grad=True)
    with cuda_autocast_rules() as applied:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = checkpoint(lambda t: F.layer_norm(t, (8,)).square(), x, use_reentrant=False)
        y.sum().backward()
    assert applied == {"layer_norm.default": 2}  # the forward and its recomputation
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


@pytest.fixture
def stock_layernorm(monkeypatch):
    """The GPT's LayerNorms as torch's, which autocast runs in fp32 on CUDA whatever the input."""
    monkeypatch.setattr(gpt.LayerNorm, "forward", nn.LayerNorm.forward)


def _fp32_copies(cfg) -> int:
    """An fp32 copy of each LayerNorm's input, two a block."""
    tokens = cfg.train.batch_size * cfg.train_seq_len
    return 2 * cfg.model.n_layer * tokens * cfg.model.d_model * 4


def _bf16_pure_gpu_plans(request, change: str):
    """A bf16-pure GPU plan of tiny, before and after the fixture `change` applies."""
    cfg = _cfg("bf16-pure")
    before = plan_memory(cfg, "cuda", gpu_caps("H100-80"))
    request.getfixturevalue(change)
    return cfg, before, plan_memory(cfg, "cuda", gpu_caps("H100-80"))


def test_a_gpu_plan_holds_the_fp32_copy_cuda_makes_of_a_bf16_layernorms_input(
    stock_layernorm, request
):
    cfg, plan, cpu_rules = _bf16_pure_gpu_plans(request, "cpu_rules_on_gpu")
    assert plan.saved_per_micro_batch - cpu_rules.saved_per_micro_batch >= _fp32_copies(cfg)
    assert plan.memory["peak"] - cpu_rules.memory["peak"] >= _fp32_copies(cfg)


def test_the_gpts_bf16_pure_layernorms_make_no_fp32_copy(request):
    """onegpu's LayerNorm runs in bf16 where its weights are (gpt.LayerNorm): a GPU plan holds
    none of the copies torch's would."""
    cfg, ours, stock = _bf16_pure_gpu_plans(request, "stock_layernorm")
    assert stock.saved_per_micro_batch - ours.saved_per_micro_batch >= _fp32_copies(cfg)


@pytest.mark.parametrize("checkpointing", ["block", "selective"])
def test_a_checkpointed_gpu_plan_recomputes_under_cudas_rules(
    stock_layernorm, checkpointing, request
):
    """Backward recomputes a checkpointed block under the rules its forward ran under: the same
    fp32 copies again (had backward run under the CPU's, the checkpoint would find other
    dtypes than it saved and raise)."""
    cfg = load_config("tiny", overrides={"model.dropout": "0", "train.precision": "bf16-pure",
                                         "memory.checkpointing": checkpointing})  # fmt: skip
    plan = plan_memory(cfg, "cuda", gpu_caps("H100-80"))
    request.getfixturevalue("cpu_rules_on_gpu")
    assert plan.memory["peak"] > plan_memory(cfg, "cuda", gpu_caps("H100-80")).memory["peak"]


def test_a_transformers_model_plans_on_a_gpu_with_its_checkpointed_norms_in_fp32(hf_folder):
    """GPT-2's transformers model keeps torch's LayerNorm: under bf16-pure, CUDA runs each in
    fp32, in its recomputation too."""
    over = hf_overrides(hf_folder("gpt2"), seq_len=64, **{"train.precision": "bf16-pure",
                        "memory.checkpointing": "block", "train.device": "cpu"})  # fmt: skip
    cfg = load_config("tiny", overrides=over)
    with cuda_autocast_rules() as applied:
        plan = plan_memory(cfg, "cuda", gpu_caps("H100-80"))
    n_norms = 2 * cfg.model.n_layer + 1  # forward; the blocks' again in backward
    assert applied["layer_norm.default"] >= 2 * n_norms
    assert plan.peak_phase


def test_an_fsdp_plan_on_gpus_runs_its_16_bit_gathers_norms_in_fp32(stock_layernorm):
    """FSDP's mixed precision gathers the weights in bf16, so the residual stream is bf16 and
    CUDA runs torch's LayerNorm on fp32 copies, in each block's recomputation too."""
    over = {"model.dropout": "0", "train.precision": "bf16", "memory.checkpointing": "block",
            "dist.strategy": "fsdp", "dist.tp": "2"}  # fmt: skip
    cfg = load_config("tiny", overrides=over)
    with cuda_autocast_rules() as applied:  # 2 x 2: each rank's plan follows FSDP's gathers
        plan_report(cfg, "H100-80", None, world_size=4)
    assert applied["layer_norm.default"] >= 2 * (2 * cfg.model.n_layer + 1)


def test_on_a_cpu_the_gpts_layernorm_gives_torchs_result_bit_for_bit(monkeypatch):
    """The CPU's autocast keeps a bf16 LayerNorm in bf16 already: the same loss and gradients."""
    cfg = load_config("tiny", overrides={"model.dropout": "0", "train.precision": "bf16-pure"})

    def step() -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        torch.manual_seed(0)
        model = gpt.GPT(cfg.model).to(torch.bfloat16)
        x = torch.randint(0, cfg.model.vocab_size, (2, cfg.model.seq_len))
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = F.cross_entropy(model(x).float().flatten(0, 1), x.flatten())
        loss.backward()
        return loss, {n: p.grad for n, p in model.named_parameters()}

    loss, grads = step()
    monkeypatch.setattr(gpt.LayerNorm, "forward", nn.LayerNorm.forward)
    stock_loss, stock_grads = step()
    assert torch.equal(loss, stock_loss)
    assert all(torch.equal(grads[n], stock_grads[n]) for n in grads)


def test_plans_whose_norms_see_fp32_are_unchanged(request):
    """bf16 keeps fp32 weights and an fp32 residual stream: its norms never see bf16, so its
    plan is the same under both rules; a CPU plan never takes CUDA's."""
    cfg = _cfg("bf16")
    caps = gpu_caps("H100-80")
    plan = plan_memory(cfg, "cuda", caps)
    request.getfixturevalue("cpu_rules_on_gpu")
    assert plan_memory(cfg, "cuda", caps).memory == plan.memory
    assert isinstance(autocast_rules("cpu"), contextlib.nullcontext)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_a_gpu_the_bf16_layernorm_trains_as_torchs_in_less_memory(monkeypatch):
    """CUDA's autocast runs torch's LayerNorm on an fp32 copy: onegpu's runs in bf16 (fp32
    statistics), which loses no accuracy that a bf16 step keeps and holds none of the copies."""
    from onegpu.backends.torch.build import build

    over = {"model.dropout": "0", "train.precision": "bf16-pure", "train.device": "cuda",
            "train.compile": "none", "memory.loss_chunk": "0", "train.batch_size": "8",
            "model.d_model": "256", "model.n_head": "4", "model.seq_len": "256"}  # fmt: skip
    cfg = load_config("tiny", overrides=over)

    def run() -> tuple[list[float], int]:
        torch.manual_seed(0)
        built = build(cfg, with_data=False)
        g = torch.Generator().manual_seed(0)
        losses = []
        for i in range(3):
            x = torch.randint(0, cfg.model.vocab_size, (8, 257), generator=g).cuda()
            torch.cuda.reset_peak_memory_stats()
            losses.append(built.step(x[:, :-1], x[:, 1:], x[:, 1:].numel(), i).loss.item())
        return losses, torch.cuda.max_memory_allocated()

    ours, ours_peak = run()
    monkeypatch.setattr(gpt.LayerNorm, "forward", nn.LayerNorm.forward)
    stock, stock_peak = run()
    assert ours == pytest.approx(stock, rel=1e-2)
    assert stock_peak - ours_peak >= _fp32_copies(cfg) // 2
