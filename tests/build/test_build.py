"""The one build: resolves once without touching the user's config, applies the techniques in
their order, and builds the same run on fake tensors for the planner."""

import copy

import torch

from onegpu.backends.torch.build import build
from onegpu.config import load_config, to_dict
from onegpu.plan.memory import plan_memory
from onegpu.techniques.approx_grads import FewBitGELU, RandomizedLinear
from onegpu.techniques.attention import cpu_candidates
from onegpu.techniques.precision import DeviceCaps


def _cfg(**over):
    return load_config("tiny", overrides={"train.device": "cpu", **over})


def test_build_resolves_auto_once_and_never_changes_the_users_config():
    cfg = _cfg(**{"train.precision": "auto", "model.attention": "auto"})
    before = copy.deepcopy(to_dict(cfg))
    built = build(cfg, with_data=False)
    assert to_dict(cfg) == before  # the user's object is untouched
    weighed = built.resolved.precision_auto  # the CPU's figures, where bf16 is native
    pays = weighed is not None and weighed["bf16_speedup"] >= weighed["margin"]
    expected = "bf16" if pays else "fp32"
    assert built.cfg.train.precision == expected == built.policy.name  # what runs, written out
    assert built.cfg.model.attention in cpu_candidates(cfg.model)  # one auto timed
    assert built.resolved.attention == built.cfg.model.attention
    assert all(a.impl == built.resolved.attention for a in (b.attn for b in built.model.blocks))


def test_techniques_apply_in_order_swaps_inside_checkpointed_blocks():
    """Approximate-gradient layers are swapped before checkpointing wraps the block, so the
    recomputed forward runs the swapped layers (same parameters, same names)."""
    plain = build(_cfg(), with_data=False)
    built = build(
        _cfg(**{"memory.gelu_bits": "2", "memory.randomized_linear": "0.5",
                "memory.checkpointing": "block"}),
        with_data=False,
    )  # fmt: skip
    block = built.model.blocks[0]
    assert isinstance(block.mlp.act, FewBitGELU) and isinstance(block.mlp.fc, RandomizedLinear)
    assert "checkpoint" in block.forward.__code__.co_names  # the wrapped forward
    assert plain.model.state_dict().keys() == built.model.state_dict().keys()
    for (name, p), q in zip(plain.model.named_parameters(), built.model.parameters(), strict=True):
        assert torch.equal(p, q), name  # the same initial weights, techniques or not


def test_every_precision_starts_from_the_same_weights():
    fp32 = build(_cfg(**{"train.precision": "fp32"}), with_data=False).model
    pure = build(_cfg(**{"train.precision": "bf16-pure"}), with_data=False).model
    for p, q in zip(fp32.parameters(), pure.parameters(), strict=True):
        assert q.dtype == torch.bfloat16 and torch.equal(p.to(torch.bfloat16), q)


def test_a_fake_build_is_the_real_build_without_memory():
    cfg = _cfg(**{"train.precision": "bf16-pure", "memory.checkpointing": "selective"})
    real = build(cfg, with_data=False)
    fake = build(cfg, torch.device("cpu"), with_data=False, fake=True)
    shapes = [(n, p.shape, p.dtype) for n, p in real.model.named_parameters()]
    assert shapes == [(n, p.shape, p.dtype) for n, p in fake.model.named_parameters()]
    assert all(type(p).__name__ == "FakeTensor" for p in fake.model.parameters())
    assert fake.n_params == real.n_params and fake.flops_per_token == real.flops_per_token


def test_a_plan_for_a_gpu_resolves_precision_from_its_capabilities():
    cfg = _cfg(**{"train.precision": "auto"})
    a100 = DeviceCaps(type="cuda", bf16=True, tf32=True)
    t4 = DeviceCaps(type="cuda", bf16=False, tf32=False)
    assert plan_memory(cfg, "cuda", a100).precision == "bf16"
    assert plan_memory(cfg, "cuda", t4).precision == "fp32"  # what `train` would run there
    tf32 = plan_memory(_cfg(**{"train.precision": "tf32"}), "cuda", a100)
    assert tf32.precision == "tf32" and tf32.compute_dtype == torch.float32


def test_every_process_runs_rank_zeros_auto_precision(monkeypatch):
    """Each process reads the CPU's matmul peaks (a process measuring them on a busy machine
    can see another ratio): rank 0's precision binds them all, with the figures it weighed."""
    import types

    from onegpu.backends.torch.resolve import resolve_agreed
    from onegpu.distributed import single_process
    from onegpu.techniques import precision

    cfg = _cfg(**{"train.precision": "auto"})
    cpu = torch.device("cpu")
    caps = DeviceCaps(type="cpu", bf16=True, tf32=False)  # native bf16, ratio not yet measured

    def on_main(choose):
        monkeypatch.setattr(precision, "cpu_bf16_speedup", lambda: 0.6)  # rank 0's reading
        decided = choose()
        monkeypatch.setattr(precision, "cpu_bf16_speedup", lambda: 6.0)  # this process's
        return decided

    ctx = types.SimpleNamespace(enabled=True, on_main=on_main, dp_size=2, strategy="ddp")
    agreed = resolve_agreed(cfg, cpu, caps, ctx, timed=True)
    assert agreed.precision.name == "fp32" == agreed.config.train.precision
    assert agreed.precision_auto == {"bf16_speedup": 0.6, "margin": precision.CPU_BF16_MARGIN}
    alone = resolve_agreed(cfg, cpu, caps, single_process(), timed=True)
    assert alone.precision.name == "bf16"  # what this process would have chosen on its own
