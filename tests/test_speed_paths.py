"""Compiled steps equal eager ones; the micro-batch loop never syncs with the device."""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from onegpu.build import build
from onegpu.train.step import forward_backward


def _loss_and_grads(cfg, x):
    built = build(cfg, with_data=False)
    scaler = built.policy.grad_scaler(built.device)
    loss = forward_backward(
        built.model, built.loss_fn, built.policy, scaler, x[:, :-1], x[:, 1:],
        n_micro=cfg.grad_accum_steps, n_tokens=x[:, 1:].numel(),
    )  # fmt: skip
    return loss.item(), {n: p.grad.clone() for n, p in built.model.named_parameters()}


@pytest.mark.parametrize("mode", ["default", "regional"])
def test_compiled_step_equals_eager(mode, tiny_cfg):
    """fp32, dropout off (inductor draws dropout masks from its own RNG stream); inductor
    reorders reductions, hence a tolerance rather than bit equality."""
    tiny_cfg.model.dropout = 0.0
    tiny_cfg.train.precision = "fp32"
    x = torch.randint(0, 256, (tiny_cfg.train.batch_size, 65))
    eager_loss, eager_grads = _loss_and_grads(tiny_cfg, x)
    tiny_cfg.train.compile = mode
    torch._dynamo.reset()
    loss, grads = _loss_and_grads(tiny_cfg, x)
    assert loss == pytest.approx(eager_loss, rel=1e-5)
    for name, g in grads.items():
        torch.testing.assert_close(g, eager_grads[name], rtol=1e-4, atol=1e-6, msg=name)


class CountScalarReads(TorchDispatchMode):
    """Counts reads of a tensor's value by the host (.item(), float(t), bool(t), ...): each one
    is a device sync on a GPU."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default:
            self.count += 1
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16"])
def test_micro_batch_loop_reads_nothing_back_from_the_device(precision, tiny_cfg):
    tiny_cfg.train.precision = precision
    built = build(tiny_cfg, with_data=False)
    scaler = built.policy.grad_scaler(built.device)
    x = torch.randint(0, 256, (tiny_cfg.train.batch_size, 65))
    assert tiny_cfg.grad_accum_steps == 2
    with CountScalarReads() as reads:
        forward_backward(
            built.model, built.loss_fn, built.policy, scaler, x[:, :-1], x[:, 1:],
            n_micro=2, n_tokens=x[:, 1:].numel(),
        )  # fmt: skip
    assert reads.count == 0
    with CountScalarReads() as reads:  # the counter does see a sync when there is one
        torch.ones(2).sum().item()
    assert reads.count == 1


def test_the_command_runs_on_tcmalloc_when_the_system_has_it(tmp_path):
    import json
    import os
    import subprocess
    import sys

    from onegpu.perf.allocator import find_tcmalloc

    def allocator(env_extra):
        out = tmp_path / f"run{len(env_extra)}"
        env = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", "ONEGPU_ALLOCATOR")}
        cmd = [sys.executable, "-m", "onegpu", "train", "--preset", "tiny", "--out", str(out)]
        cmd += ["--train.max_steps", "2", "--train.device", "cpu", "--out.progress", "false"]
        subprocess.run(cmd, env={**env, **env_extra}, check=True, capture_output=True)
        return json.loads((out / "summary.json").read_text())["allocator"]

    assert allocator({}) == ("tcmalloc" if find_tcmalloc() else "system")
    assert allocator({"ONEGPU_ALLOCATOR": "system"}) == "system"
