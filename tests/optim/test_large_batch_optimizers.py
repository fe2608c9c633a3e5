"""Large-batch and low-memory optimizers (LAMB, LARS from pytorch-optimizer; torchao's 4-bit
AdamW) and the learning-rate scaling rules: what each keeps, that it trains, what it refuses."""

import json
import math

import pytest
import torch

from onegpu.cli import main
from onegpu.config import ConfigError, load_config
from onegpu.config.schedule import scaled_optim
from onegpu.models.gpt import GPT
from onegpu.optim import build_optimizer
from onegpu.optim.state_bytes import optimizer_state_bytes, predicted_state_bytes
from onegpu.train import train


@pytest.mark.parametrize(
    "name",
    ["lamb", "lars", pytest.param("adamw4bit", marks=pytest.mark.slow)],  # compiles: 20 s
)
def test_the_allocation_rule_counts_the_real_states(name):
    """The planner counts these states by rule (their steps do not run on fake tensors):
    the rule against the real optimizer's states after a step, on a GPT's shapes."""
    cfg = load_config("tiny", overrides={"optim.name": name})
    torch.manual_seed(0)
    model = GPT(cfg.model)
    opt = build_optimizer(model, cfg.optim, torch.device("cpu"))
    for p in model.parameters():
        p.grad = torch.randn_like(p) * 1e-3
    opt.step()
    params = list(model.parameters())
    assert optimizer_state_bytes(opt) == predicted_state_bytes(name, params)
    per_param = optimizer_state_bytes(opt) / sum(p.numel() for p in params)
    assert per_param == pytest.approx({"lamb": 8, "lars": 4, "adamw4bit": 1.0}[name], rel=0.25)


@pytest.mark.slow  # two short runs (~9 s)
@pytest.mark.parametrize("name", ["lamb", "lars"])
def test_a_trust_ratio_optimizer_trains(name, tmp_path):
    lr = {"lamb": "2e-2", "lars": "0.5"}[name]
    over = {"optim.name": name, "optim.lr": lr, "train.max_steps": "30", "train.device": "cpu",
            "train.eval_every": "0", "checkpoint.every": "0", "out.progress": "false",
            "out.dir": str(tmp_path), "optim.warmup_steps": "5", "train.log_every": "1"}  # fmt: skip
    summary = train(load_config("tiny", overrides=over))
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    first = next(r["loss"] for r in rows if "loss" in r)
    assert math.isfinite(summary["loss"]) and summary["loss"] < first - 0.5


def test_the_learning_rate_scales_with_the_batch():
    base = {"optim.lr": "1e-3", "optim.base_batch": "16", "train.batch_size": "64",
            "train.micro_batch_size": "16"}  # fmt: skip
    linear = load_config("tiny", overrides={**base, "optim.lr_scaling": "linear"})
    sqrt = load_config("tiny", overrides={**base, "optim.lr_scaling": "sqrt"})
    none = load_config("tiny", overrides=base)
    assert scaled_optim(linear).lr == pytest.approx(4e-3)
    assert scaled_optim(sqrt).lr == pytest.approx(2e-3)
    assert scaled_optim(none).lr == 1e-3
    assert linear.optim.lr == 1e-3  # the config keeps what the user wrote


@pytest.mark.parametrize(
    ("over", "field"),
    [
        ({"optim.lr_scaling": "linear"}, "optim.base_batch"),
        ({"optim.base_batch": "-1"}, "optim.base_batch"),
        ({"optim.name": "lamb", "train.precision": "bf16-pure"}, "optim.name"),
        ({"optim.name": "lars", "train.backend": "jax"}, "optim.name"),
    ],
)
def test_what_cannot_run_is_refused_in_one_line(over, field, capsys):
    with pytest.raises(ConfigError) as e:
        load_config("tiny", overrides=over)
    assert e.value.field_name == field
    args = ["train", "--preset", "tiny"]
    for k, v in over.items():
        args += [f"--{k}", v]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"onegpu: error: {field}:") and len(err.strip().splitlines()) == 1


def test_a_missing_package_names_the_extra(monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "pytorch_optimizer", None)  # import fails
    cfg = load_config("tiny", overrides={"optim.name": "lamb"})
    with pytest.raises(ConfigError, match=r"onegpu\[optimizers\]"):
        build_optimizer(GPT(cfg.model), cfg.optim, torch.device("cpu"))
