"""Host-step pricing: this CPU's measured rate, scaled to the host a plan names, and a GPU's
memory capped by --memory."""

import torch

from onegpu.config import load_config
from onegpu.offload.host_step import host_step_rate, priced_for
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
