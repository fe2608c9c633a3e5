"""The planner on transformers models: saved bytes exact and the peak within 5% of a real
step, for each architecture tested, with the planner's fake build of the folder's config."""

import pytest
from conftest import HF_ARCHS, hf_overrides

from onegpu.backends.torch.step_memory import measure_real_step
from onegpu.config import load_config
from onegpu.plan.memory import plan_memory


def _cfg(folder, **over):
    return load_config("tiny", overrides=hf_overrides(folder, seq_len=64, **over))


@pytest.mark.parametrize("arch", HF_ARCHS)
def test_plan_equals_a_real_step(arch, hf_folder):
    cfg = _cfg(hf_folder(arch))
    plan = plan_memory(cfg)
    built, measured = measure_real_step(cfg)
    assert plan.n_params == built.n_params
    assert plan.saved_per_micro_batch == measured["saved_activations_per_micro_batch"]
    assert plan.memory["peak"] == pytest.approx(measured["peak"], rel=0.05)
    assert set(plan.saved_by_block) >= {"blocks.0", "blocks.1"}


@pytest.mark.slow
@pytest.mark.parametrize(
    "over",
    [
        {"memory.checkpointing": "block"},
        {"memory.checkpointing": "selective"},
        {"memory.loss_chunk": "128"},
        {"train.precision": "bf16"},
    ],
)
def test_plan_with_techniques_on_llama(over, hf_folder):
    cfg = _cfg(hf_folder("llama"), **over)
    plan = plan_memory(cfg)
    _, measured = measure_real_step(cfg)
    assert plan.saved_per_micro_batch == measured["saved_activations_per_micro_batch"]
    assert plan.memory["peak"] == pytest.approx(measured["peak"], rel=0.05)
