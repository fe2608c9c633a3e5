"""The one step: no host-device sync anywhere in the loop, and fp16's skipped steps."""

import math

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from onegpu import train as trainer
from onegpu.backends.torch.build import build
from onegpu.backends.torch.step import TrainStep
from onegpu.config import load_config


class CountScalarReads(TorchDispatchMode):
    """Counts reads of a tensor's value by the host (.item(), float(t), bool(t), .tolist()):
    each one is a device sync on a GPU."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default:
            self.count += 1
        return func(*args, **(kwargs or {}))


def _reads_of_a_run(tmp_path, precision: str, steps: int) -> int:
    cfg = load_config(
        "tiny",
        overrides={
            "train.device": "cpu",
            "train.precision": precision,
            "train.max_steps": str(steps),
            "train.log_every": str(steps),  # one log step, at the end
            "train.eval_every": "0",
            "train.measure_memory": "false",
            "out.progress": "false",
            "out.save_checkpoint": "false",
            "out.dir": str(tmp_path / f"{precision}-{steps}"),
        },
    )
    with CountScalarReads() as reads:
        trainer.train(cfg)
    return reads.count


@pytest.mark.parametrize(
    "precision", [pytest.param(p, marks=pytest.mark.slow) for p in ("fp32", "bf16", "fp16")]
)
def test_the_training_loop_reads_the_device_only_at_log_steps(precision, tmp_path):
    """The whole loop (data, step, metrics), not only the step: a run of 12 steps and one of 4,
    each with one log step, read the device equally often. A read inside any step would make
    the longer run read more."""
    short = _reads_of_a_run(tmp_path, precision, 4)
    long = _reads_of_a_run(tmp_path, precision, 12)
    assert long == short, (short, long)
    with CountScalarReads() as reads:  # the counter does see a sync when there is one
        torch.ones(2).sum().item()
    assert reads.count == 1


def test_fp16_inf_gradient_skips_the_step_flags_it_and_lowers_the_scale(tiny_cfg):
    tiny_cfg.train.precision = "fp16"
    built = build(tiny_cfg, torch.device("cpu"), with_data=False)
    model, step = built.model, built.step
    x = torch.randint(0, 256, (4, 64))
    step(x, x, x.numel(), 0)  # optimizer states exist
    scale = step.scaler.get_scale()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    state = {k: v.clone() for k, v in built.optimizer.state[model.wte.weight].items()}
    handle = model.blocks[0].mlp.fc.weight.register_hook(lambda g: torch.full_like(g, math.inf))
    out = step(x, x, x.numel(), 1)
    handle.remove()
    assert out.skipped.item() == 1 and not math.isfinite(out.grad_norm.item())
    assert step.scaler.get_scale() == scale / 2  # backed off by half
    for n, p in model.named_parameters():
        assert torch.equal(p, before[n]), n  # nothing moved: the step was skipped
    for k, v in built.optimizer.state[model.wte.weight].items():
        assert torch.equal(v, state[k]), k  # nor did the optimizer's state
    out = step(x, x, x.numel(), 2)
    assert out.skipped.item() == 0
    assert not torch.equal(model.blocks[0].mlp.fc.weight, before["blocks.0.mlp.fc.weight"])


def test_the_trainer_counts_and_logs_skipped_fp16_steps(tmp_path, monkeypatch):
    calls = {"n": 0}
    real = TrainStep.forward_backward

    def poisoned(self, *args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 3:
            h = self.model.wte.weight.register_hook(lambda g: torch.full_like(g, math.nan))
            try:
                return real(self, *args, **kwargs)
            finally:
                h.remove()
        return real(self, *args, **kwargs)

    monkeypatch.setattr(TrainStep, "forward_backward", poisoned)
    over = {"train.device": "cpu", "train.precision": "fp16", "train.max_steps": "4",
            "train.eval_every": "0", "train.measure_memory": "false", "out.progress": "false", "out.save_checkpoint": "false",
            "out.dir": str(tmp_path / "run")}  # fmt: skip
    s = trainer.train(load_config("tiny", overrides=over))
    assert s["skipped_steps"] == 1
    rows = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    assert '"skipped_steps": 1' in rows[-1] and '"loss_scale"' in rows[-1]


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_a_step_without_loss_scaling_never_flags_a_skip(precision, tiny_cfg):
    tiny_cfg.train.precision = precision
    built = build(tiny_cfg, torch.device("cpu"), with_data=False)
    x = torch.randint(0, 256, (8, 64))
    out = built.step(x, x, x.numel(), 0)
    assert out.skipped.item() == 0 and out.loss.dim() == 0 and out.grad_norm.item() > 0
    assert built.step.log_extras() == {}


@pytest.mark.parametrize(("precision", "optimizer"), [("fp32", "adamw"), ("bf16", "adamw"),
                                                      ("bf16-pure", "adamw"), ("fp32", "sgd")])  # fmt: skip
@pytest.mark.parametrize("poison", ["loss", "gradient"])
def test_a_non_finite_loss_or_gradient_skips_the_update(precision, optimizer, poison, tiny_cfg):
    tiny_cfg.train.precision, tiny_cfg.optim.name = precision, optimizer
    built = build(tiny_cfg, torch.device("cpu"), with_data=False)
    model, step = built.model, built.step
    x = torch.randint(0, 256, (8, 64))
    step(x, x, x.numel(), 0)  # optimizer states exist
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    state = {k: _copy(v) for k, v in built.optimizer.state[model.wte.weight].items()}
    if poison == "loss":  # a non-finite loss with finite gradients (e.g. a huge logit sum)
        real = step.loss_fn
        step.loss_fn = lambda m, a, b: (
            real(m, a, b) + (torch.tensor(math.inf) - real(m, a, b).detach())
        )
    else:
        h = model.blocks[1].attn.q.weight.register_hook(lambda g: torch.full_like(g, math.nan))
    out = step(x, x, x.numel(), 1)
    step.loss_fn = real if poison == "loss" else step.loss_fn
    if poison == "gradient":
        h.remove()
    assert out.skipped.item()
    for n, p in model.named_parameters():
        assert torch.equal(p, before[n]), n
    for k, v in built.optimizer.state[model.wte.weight].items():
        assert torch.equal(v, state[k]) if torch.is_tensor(v) else v == state[k], k
    assert not step(x, x, x.numel(), 2).skipped.item()  # and training goes on


def _copy(v):
    return v.clone() if torch.is_tensor(v) else v
