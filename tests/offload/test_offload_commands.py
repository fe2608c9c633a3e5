"""Every command that builds gets every offload option, applied by the build or planned the same
way, without remembering to: train, profile and bench report where the bytes lived
(offload/homes.py, read from what the build made), plan and tune plan them there."""

import pytest

from onegpu.config import load_config
from onegpu.plan.report import plan_report

OPTIONS = {
    "optimizer on host": ({"memory.offload_optimizer": "true"}, {"optimizer": "host"}, "host"),
    "optimizer on disk": (
        {"memory.offload_optimizer": "true", "memory.offload_dir": "{tmp}"},
        {"optimizer": "disk"},
        "disk",
    ),
    "weights on host": (
        {"memory.offload_params": "true"},
        {"weights": "host", "optimizer": "host"},
        "host",
    ),
    "activations on host": (
        {"memory.offload_activations": "true"},
        {"activations": "host"},
        "host",
    ),
}
FAST = ()  # a run per option: all in the slow suite (plan and tune stay fast)
NONE = {"optimizer": "device", "weights": "device", "activations": "device"}


def _cfg(tmp_path, name, **over):
    option = {k: v.replace("{tmp}", str(tmp_path / "states")) for k, v in OPTIONS[name][0].items()}
    values = {"train.max_steps": "2", "train.eval_every": "0", "train.precision": "fp32",
              "train.measure_memory": "false", "out.progress": "false",
              "out.dir": str(tmp_path / "run"), "train.skip_memory_check": "true",
              **option, **over}  # fmt: skip
    return load_config("tiny", overrides=values)


def _expected(name):
    return NONE | OPTIONS[name][1]


@pytest.mark.parametrize(
    "name",
    [n if n in FAST else pytest.param(n, marks=pytest.mark.slow) for n in OPTIONS],
)
def test_train_runs_the_option(name, tmp_path):
    from onegpu.train import train

    summary = train(_cfg(tmp_path, name))
    assert summary["offload"] == _expected(name)
    assert summary["floor_s"] > 0  # where bytes live changes no product: the floor is there


@pytest.mark.slow  # a profiled run per option (train and plan stay in the fast suite)
@pytest.mark.parametrize("name", OPTIONS)
def test_profile_runs_the_option(name, tmp_path):
    from onegpu.tools.profile import profile

    text = profile(_cfg(tmp_path, name), steps=1, warmup=0)["summary"]
    homes = ", ".join(f"{k} {v}" for k, v in _expected(name).items())
    assert f"where bytes live: {homes}" in text
    assert "\nmatmul floor: " in text


@pytest.mark.parametrize("name", OPTIONS)
def test_plan_and_tune_plan_the_option(name, tmp_path):
    from onegpu.plan.fixes import planned
    from onegpu.plan.targets import gpu_caps

    home = OPTIONS[name][2]
    cfg = _cfg(tmp_path, name)
    plain = load_config("tiny", overrides={"train.precision": "fp32"})
    report = plan_report(cfg, "RTX4090", None)
    assert report["memory"].get(home, 0) > 0
    assert plan_report(plain, "RTX4090", None)["memory"].get(home, 0) == 0
    # what tune's search by prediction, the fix list and the start-up check plan with
    caps = gpu_caps("RTX4090")
    ours, theirs = (
        planned(c, "cuda", caps, "RTX4090", fast=True, speed=False) for c in (cfg, plain)
    )
    assert ours.peak < theirs.peak and ours.host > 0


@pytest.mark.slow  # a real `onegpu train` process per row
@pytest.mark.parametrize("name", OPTIONS)
def test_a_bench_row_runs_the_option(name, tmp_path):
    from onegpu.tools.bench import WARM_STEPS, run_row

    option = {k: v.replace("{tmp}", str(tmp_path / "states")) for k, v in OPTIONS[name][0].items()}
    over = {"train.precision": "fp32", **option}
    row = run_row("tiny", None, over, WARM_STEPS + 2, tmp_path)
    assert row["offload"] == _expected(name)
