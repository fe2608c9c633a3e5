"""Autocast's 16-bit copies of the weights are made once per optimizer step, not once per
micro-batch (PrecisionPolicy.casts_once), and nothing a step computes changes."""

import contextlib

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from onegpu.backends.torch.build import build
from onegpu.backends.torch.step import reuses_casts
from onegpu.config import load_config
from onegpu.distributed import DistContext, single_process

CPU = torch.device("cpu")


def _cfg(micro: int, **over):
    values = {
        "train.device": "cpu",
        "train.precision": "bf16",
        "train.compile": "none",
        "train.batch_size": "8",
        "train.micro_batch_size": str(micro),
        "model.dropout": "0.0",
        **over,
    }
    return load_config("tiny", overrides=values)


class WeightCasts(TorchDispatchMode):
    """Counts the 16-bit copies made of parameters."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        cast = func is torch.ops.aten._to_copy.default and kwargs.get("dtype") == torch.bfloat16
        self.count += int(cast and isinstance(args[0], nn.Parameter))
        return func(*args, **kwargs)


def _batch(cfg):
    g = torch.Generator().manual_seed(0)
    shape = (cfg.train.batch_size, cfg.train_seq_len)
    x = torch.randint(0, cfg.model.vocab_size, shape, generator=g)
    y = torch.randint(0, cfg.model.vocab_size, shape, generator=g)
    return x, y


def _casts_in_one_step(micro: int) -> int:
    cfg = _cfg(micro)
    built = build(cfg, CPU, with_data=False)
    x, y = _batch(cfg)
    with WeightCasts() as casts:
        built.step.forward_backward(x, y, y.numel())
    return casts.count


def test_a_step_of_four_micro_batches_casts_each_weight_once():
    once = _casts_in_one_step(micro=8)  # one micro-batch: each matmul weight cast once
    assert once > 0
    assert _casts_in_one_step(micro=2) == once


def test_steps_that_reuse_the_copies_are_bit_identical_to_steps_that_do_not():
    """Two optimizer steps (AdamW, lr > 0: the second step's copies must be of the updated
    weights), four micro-batches each: the same losses, gradient norms and weights, bit for
    bit, as casting again in every micro-batch."""
    runs = []
    for reuse in (True, False):
        cfg = _cfg(micro=2)
        built = build(cfg, CPU, with_data=False)
        if not reuse:
            built.step._casts = contextlib.nullcontext
        x, y = _batch(cfg)
        outs = [built.step(x, y, y.numel(), index) for index in range(2)]
        runs.append(
            (
                [(o.loss.item(), o.grad_norm.item()) for o in outs],
                [p.detach().clone() for p in built.model.parameters()],
            )
        )
    (losses_a, weights_a), (losses_b, weights_b) = runs
    assert losses_a == losses_b
    assert all(torch.equal(a, b) for a, b in zip(weights_a, weights_b, strict=True))
    assert torch.autocast_increment_nesting() == 1  # every region the steps held was released
    torch.autocast_decrement_nesting()


@pytest.mark.parametrize(
    ("over", "dist", "reused"),
    [
        ({}, single_process(), True),
        ({}, DistContext(strategy="ddp", world_size=2), True),
        ({"memory.checkpointing": "block"}, single_process(), False),
        ({"memory.checkpointing": "selective"}, single_process(), False),
        ({"memory.checkpointing": "every:2"}, single_process(), False),
        ({"memory.offload_activations": "true"}, single_process(), False),
        ({"memory.offload_params": "true"}, single_process(), False),
        ({}, DistContext(strategy="fsdp", world_size=2), False),
        ({"model.seq_len": "16", "train.micro_batch_size": "1"}, single_process(), False),
    ],
)
def test_steps_whose_peak_the_held_copies_would_raise_cast_again(over, dist, reused):
    """Checkpointing and activations on the host drop the copies before backward ends, FSDP
    gathers 16-bit weights itself, and a weight-bound step (16 tokens a micro-batch) peaks late
    in backward, where the held copies would add to the peak (+8% in its plan)."""
    assert reuses_casts(_cfg(micro=2, **over), dist) is reused
