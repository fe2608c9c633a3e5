"""Mixtures of experts plan as dense models do (the peak within 5% of a real CPU step, saved
bytes exact), their expert matmuls run in the autocast dtype (models/hf/patches.py), a model
whose experts route with data-dependent shapes is refused by `plan` in one line and trains
with the start-up check skipped, and the router's balancing term is logged."""

import json

import pytest
import torch

from onegpu.backends.torch.step_memory import measure_real_step
from onegpu.config import load_config
from onegpu.plan.memory import plan_memory

transformers = pytest.importorskip("transformers")

_COMMON = dict(
    vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
)  # fmt: skip


def _config(arch: str, **extra):
    if arch == "mixtral":
        return transformers.MixtralConfig(
            **_COMMON, num_local_experts=4, num_experts_per_tok=2, output_router_logits=True,
            router_aux_loss_coef=0.02, **extra,
        )  # fmt: skip
    if arch == "qwen3_moe":
        return transformers.Qwen3MoeConfig(
            **_COMMON, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=48,
            head_dim=16, output_router_logits=True, **extra,
        )  # fmt: skip
    return transformers.DeepseekV3Config(  # aux-loss-free balancing: no router loss
        **_COMMON, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=48, n_group=1,
        topk_group=1, first_k_dense_replace=1, q_lora_rank=None, kv_lora_rank=16,
        qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16, **extra,
    )  # fmt: skip


def _folder(tmp_path, arch: str, **extra):
    path = tmp_path / arch
    _config(arch, **extra).save_pretrained(path)
    return path


def _overrides(folder, precision: str) -> dict[str, str]:
    return {"model.hf": str(folder), "model.seq_len": "64", "train.device": "cpu",
            "train.precision": precision, "train.batch_size": "8",
            "train.micro_batch_size": "8", "out.progress": "false"}  # fmt: skip


@pytest.mark.parametrize(
    "arch,precision",
    [
        pytest.param("mixtral", "fp32", marks=pytest.mark.slow),
        ("mixtral", "bf16"),
        pytest.param("qwen3_moe", "bf16", marks=pytest.mark.slow),
        pytest.param("deepseek_v3", "fp32", marks=pytest.mark.slow),
        pytest.param("deepseek_v3", "bf16", marks=pytest.mark.slow),
    ],
)
def test_a_mixture_of_experts_plans_like_a_real_step(tmp_path, arch, precision):
    cfg = load_config(overrides=_overrides(_folder(tmp_path, arch), precision))
    plan = plan_memory(cfg)
    built, measured = measure_real_step(cfg)
    assert plan.n_params == built.n_params
    assert plan.memory["peak"] == pytest.approx(measured["peak"], rel=0.05)
    saved = measured["saved_activations_per_micro_batch"]
    assert plan.saved_per_micro_batch == pytest.approx(saved, rel=1e-3)


def test_expert_matmuls_run_in_the_autocast_dtype_and_train_fp32_masters(monkeypatch):
    import transformers.integrations.moe as moe

    from onegpu.models.hf.patches import experts_in_compute_dtype

    seen = []
    original = moe._grouped_mm

    def spy(input, weight, offs):
        seen.append((input.dtype, weight.dtype))
        return original(input, weight, offs)

    monkeypatch.setattr(moe, "_grouped_mm", spy)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(12, 16, generator=gen)
    w = torch.randn(3, 16, 8, generator=gen, requires_grad=True)
    offs = torch.tensor([4, 8, 12], dtype=torch.int32)
    with experts_in_compute_dtype(), torch.autocast("cpu", dtype=torch.bfloat16):
        out = moe._grouped_mm(x, w, offs)
    assert seen == [(torch.bfloat16, torch.bfloat16)] and out.dtype == torch.bfloat16
    out.float().sum().backward()
    assert w.grad is not None and w.grad.dtype == torch.float32
    ref = torch.cat([x[a:b].bfloat16() @ w[i].bfloat16() for i, (a, b) in
                     enumerate(zip([0, 4, 8], [4, 8, 12]))])  # fmt: skip
    torch.testing.assert_close(out, ref.detach())
    with experts_in_compute_dtype():  # no autocast: the weights' dtype, as transformers does
        moe._grouped_mm(x, w, offs)
    assert seen[-1] == (torch.float32, torch.float32)
    assert moe._grouped_mm is spy  # put back when the context ends


def test_the_patched_experts_function_keeps_its_signature():
    import inspect

    import transformers.integrations.moe as moe

    from onegpu.models.hf import patches

    module, name = patches.PATCHED_EXPERTS.rsplit(".", 1)
    assert moe.__name__ == module
    assert list(inspect.signature(getattr(moe, name)).parameters) == ["input", "weight", "offs"]
    assert inspect.getsource(moe).count(f"{name}(") >= 3  # the def and its calls


@pytest.mark.slow
def test_data_dependent_experts_are_refused_by_plan_and_skipped_by_the_start_check(
    tmp_path, capsys
):
    from onegpu.cli import main

    folder = _folder(tmp_path, "mixtral")  # as a user writes it (save_pretrained drops it)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(config | {"experts_implementation": "eager"}))
    args = [f"--{k}={v}" for k, v in _overrides(folder, "fp32").items()]
    assert main(["plan", *args]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "experts_implementation" in err[0] and "Traceback" not in err[0]
    out = tmp_path / "run"
    rc = main(["train", *args, "--train.max_steps=2", "--train.log_every=1", f"--out={out}"])
    assert rc == 0
    assert "memory check skipped" in capsys.readouterr().err
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    logged = [r["router_aux_loss"] for r in rows if "loss" in r]
    assert len(logged) == 2 and all(0 < a < 1 for a in logged)


@pytest.mark.parametrize(
    "checkpointing", ["block", pytest.param("selective", marks=pytest.mark.slow)]
)
def test_checkpointed_experts_recompute_as_the_forward_ran_them(tmp_path, checkpointing):
    """A checkpointed block recomputes its experts in backward, outside the model's forward
    call: transformers' own function ran them there in fp32 (its cast to the weights' dtype),
    which torch refuses against the forward's bf16 tensors in a real step, and which the fake
    tensors' shape rule refuses in a plan of fp32 weights (DeepSeek-V2 with selective
    checkpointing, Qwen3-MoE's fix list)."""
    from onegpu.backends.torch.build import build

    folder = _folder(tmp_path, "qwen3_moe")
    over = {"memory.checkpointing": checkpointing, "train.compile": "none"}
    cfg = load_config(overrides={**_overrides(folder, "bf16"), **over})
    built = build(cfg, torch.device("cpu"), with_data=False)
    x = torch.randint(0, 256, (8, 65), generator=torch.Generator().manual_seed(0))
    out = built.step(x[:, :-1], x[:, 1:], 8 * 64, 0)
    assert torch.isfinite(out.loss) and not out.skipped
    for precision in ("fp32", "bf16"):
        cfg = load_config(overrides={**_overrides(folder, precision), **over})
        assert plan_memory(cfg).memory["peak"] > 0
