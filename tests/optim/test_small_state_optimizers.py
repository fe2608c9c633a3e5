"""GaLore, APOLLO, APOLLO-Mini (optim/low_rank.py) and Adam-mini (optim/adam_mini.py): their
states planned to the byte; their steps (and the low-rank methods' projections) the same whether
a parameter steps with the others, alone in backward or on the host; their checkpoints loadable
with weights_only; their bad inputs refused in one line."""

import io

import pytest
import torch

from onegpu.backends.torch.build import build
from onegpu.backends.torch.step_memory import measure_real_step
from onegpu.config import ConfigError, load_config
from onegpu.plan.memory import plan_memory

CPU = torch.device("cpu")
METHODS = {
    "galore": {"optim.name": "galore", "optim.rank": "16"},
    "apollo": {"optim.name": "apollo", "optim.rank": "16"},
    "apollo-mini": {"optim.name": "apollo-mini"},
    "adam-mini": {"optim.name": "adam-mini"},
}


def _cfg(**over):
    values = {"train.device": "cpu", "train.precision": "fp32", "optim.update_proj_gap": "2",
              "memory.loss_chunk": "0", "model.attention": "sdpa", "optim.grad_clip": "0"}  # fmt: skip
    return load_config("tiny", overrides={**values, **over})


def _run(cfg, n: int = 4):
    """n steps on fixed random batches: the built run and its losses."""
    built = build(cfg, CPU, with_data=False)
    g = torch.Generator().manual_seed(0)
    losses = []
    for i in range(n):
        x = torch.randint(0, 256, (8, 65), generator=g)
        losses.append(built.step(x[:, :-1], x[:, 1:], x[:, 1:].numel(), i).loss.item())
    return built, losses


def _same_weights(a, b) -> bool:
    sa, sb = a.model.state_dict(), b.model.state_dict()
    return all(torch.equal(sa[k], sb[k]) for k in sa)


@pytest.mark.parametrize(
    "method",
    [
        pytest.param(
            m, marks=[pytest.mark.slow] if m in ("galore", "apollo", "apollo-mini") else []
        )
        for m in METHODS
    ],
)
def test_planned_state_bytes_equal_the_measured_and_undercut_adamw(method):
    cfg = _cfg(**METHODS[method])
    planned = plan_memory(cfg).memory["optimizer"]
    _, measured = measure_real_step(cfg)
    assert planned == measured["optimizer"]
    assert planned < plan_memory(_cfg()).memory["optimizer"]  # AdamW's: 8 bytes a weight


@pytest.mark.parametrize("method", METHODS)
def test_in_backward_and_on_the_host_step_the_same_projections(method):
    """A new projection every 2 steps, each matrix's drawn from its own seed and step: the
    same whether the optimizer steps every matrix after backward, each alone inside backward,
    or on host copies; bit for bit on a CPU."""
    over = METHODS[method]
    plain = _run(_cfg(**over))
    alone = _run(_cfg(**over, **{"optim.in_backward": "true", "train.micro_batch_size": "4"}))
    host = _run(_cfg(**over, **{"memory.offload_optimizer": "true"}))
    assert alone[0].optimizer.steps_in_backward
    assert plain[1] == alone[1] == host[1]
    assert _same_weights(plain[0], alone[0]) and _same_weights(plain[0], host[0])


@pytest.mark.parametrize("method", METHODS)
def test_the_loss_falls_with_clipping_and_accumulation(method):
    """One batch learned by heart (random tokens are otherwise at ln 256 already)."""
    cfg = _cfg(**METHODS[method], **{"optim.lr": "1e-2", "optim.grad_clip": "0.5",
                                     "train.micro_batch_size": "2"})  # fmt: skip
    built = build(cfg, CPU, with_data=False)
    x = torch.randint(0, 256, (8, 65), generator=torch.Generator().manual_seed(0))
    losses = [built.step(x[:, :-1], x[:, 1:], x[:, 1:].numel(), i).loss.item() for i in range(25)]
    assert losses[-1] < losses[0] - 0.3


@pytest.mark.parametrize("method", METHODS)
def test_a_checkpoint_loads_with_weights_only_and_continues_exactly(method):
    """The projectors are written as tensors and numbers (torch.load(weights_only=True)
    refuses objects) and rebuilt on load; a new projection after the load draws what the
    uninterrupted run drew."""
    cfg = _cfg(**METHODS[method])
    straight, _ = _run(cfg, n=5)
    first, _ = _run(cfg, n=3)
    buffer = io.BytesIO()
    torch.save({"model": first.model.state_dict(), "optim": first.optimizer.state_dict()}, buffer)
    buffer.seek(0)
    saved = torch.load(buffer, weights_only=True)
    resumed = build(cfg, CPU, with_data=False)
    resumed.model.load_state_dict(saved["model"])
    resumed.optimizer.load_state_dict(saved["optim"])
    g = torch.Generator().manual_seed(0)
    batches = [torch.randint(0, 256, (8, 65), generator=g) for _ in range(5)]
    torch.manual_seed(1234)  # the global generator is not what the projections draw from
    for i in (3, 4):
        x = batches[i]
        resumed.step(x[:, :-1], x[:, 1:], x[:, 1:].numel(), i)
    assert _same_weights(straight, resumed)


@pytest.mark.parametrize(
    ("over", "field"),
    [
        ({"optim.name": "galore"}, "optim.rank"),  # tiny's matrices are 64 wide: none above 128
        ({"optim.name": "apollo", "train.precision": "bf16-pure"}, "optim.name"),
        ({"optim.name": "apollo-mini", "train.backend": "jax"}, "optim.name"),
        ({"optim.name": "adam-mini", "train.precision": "bf16-pure"}, "optim.name"),
        ({"optim.name": "galore", "optim.update_proj_gap": "0"}, "optim.update_proj_gap"),
    ],
    ids=["rank-above-every-matrix", "bf16-pure", "jax", "adam-mini-bf16-pure", "gap-zero"],
)
def test_bad_inputs_are_refused_naming_the_field(over, field):
    with pytest.raises(ConfigError) as e:
        build(_cfg(**over), CPU, with_data=False)
    assert e.value.field_name == field


def test_a_missing_package_names_the_extra(monkeypatch):
    import builtins

    real = builtins.__import__

    def no_package(name, *args, **kwargs):
        if name.startswith("pytorch_optimizer"):
            raise ImportError("No module named 'pytorch_optimizer'")
        return real(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_package)
    with pytest.raises(ConfigError, match=r"onegpu\[optimizers\]"):
        build(_cfg(**METHODS["apollo-mini"]), CPU, with_data=False)
