"""Host-step pricing: this CPU's measured rate, scaled to the host a plan names, and a GPU's
memory capped by --memory."""

import pytest
import torch

from onegpu.config import load_config
from onegpu.optim.host_step import host_step_rate, priced_for
from onegpu.plan.report import plan_report
from onegpu.plan.targets import CUDA_OVERHEAD_BYTES


def test_a_host_step_is_priced_for_the_cores_the_plan_names():
    here, how = host_step_rate("adamw")
    with priced_for(4 * torch.get_num_threads()):
        scaled, scaled_how = host_step_rate("adamw")
    assert scaled == 4 * here
    assert "scaled to" in scaled_how and "scaled to" not in how
    assert host_step_rate("adamw")[0] == here  # only inside priced_for


def test_memory_with_a_gpu_caps_its_tensor_bytes():
    cfg = load_config("tiny", overrides={"train.device": "cpu"})
    cap = 10 * 2**30
    r = plan_report(cfg, "RTX4090", cap)
    assert r["capacity_bytes"] == cap + CUDA_OVERHEAD_BYTES
    assert r["headroom_bytes"] == cap - r["memory"]["peak"]


def test_a_host_step_is_timed_over_the_weights_the_host_holds(monkeypatch, tmp_path):
    """bf16-pure keeps bf16 weights on the host and steps them there (Kahan-compensated;
    torchao's 8-bit step at 0.7x its fp32 rate over them); bf16 autocast keeps fp32 masters.
    Each dtype is timed as itself, as onegpu builds it, and cached apart."""
    from onegpu.optim import host_step

    timed = []

    def measure(name, dtype):
        timed.append((name, dtype))
        return {torch.float32: 4e8, torch.bfloat16: 1e8}[dtype]

    monkeypatch.setattr(host_step, "_measure", measure)
    monkeypatch.setenv("ONEGPU_CACHE", str(tmp_path))  # nothing timed yet
    rates = {}
    for precision in ("bf16-pure", "bf16"):
        over = {"train.device": "cpu", "train.precision": precision, "optim.name": "sgd",
                "memory.offload_optimizer": "true", "optim.lr": "0.125"}  # fmt: skip
        r = plan_report(load_config("tiny", overrides=over), "RTX4090", None)
        rates[precision] = r["offload"]["host_step_s"]
    assert timed == [("sgd", torch.bfloat16), ("sgd", torch.float32)]
    assert rates["bf16-pure"] == pytest.approx(4 * rates["bf16"])
    kahan = host_step._optimizer("sgd", torch.zeros(4, 1024, dtype=torch.bfloat16))
    assert type(kahan).__name__ == "KahanSGD"  # what the host tier runs over bf16 weights
