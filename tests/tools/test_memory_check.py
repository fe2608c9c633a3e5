"""`onegpu train` plans before it allocates: a run that cannot fit is refused at once (exit 2,
the planner's figure and fixes, nothing written); the plan is cached per configuration; a
configuration the planner cannot follow is one line and the run starts, while the user's own
configuration errors are still refused in one line."""

import json

import pytest
import torch

from onegpu.cli import main
from onegpu.config import ConfigError, load_config
from onegpu.plan import startup as memory_check

CPU = torch.device("cpu")


@pytest.mark.slow  # the fix list runs, then a real tiny run
def test_a_run_that_cannot_fit_is_refused_before_anything_is_written(tmp_path, monkeypatch, capsys):
    need = memory_check.planned_need(load_config("tiny", overrides={"train.device": "cpu"}), "cpu")
    monkeypatch.setattr(memory_check, "available_host_bytes", lambda: need["peak"] // 2)
    run = tmp_path / "run"
    args = ["train", "--preset", "tiny", "--train.device", "cpu", "--train.max_steps", "2",
            "--out.dir", str(run)]  # fmt: skip
    assert main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert "train.skip_memory_check: the planner predicts a peak of" in err
    assert "--train.skip_memory_check true" in err and not run.exists()
    assert main([*args, "--train.skip_memory_check", "true", "--out.progress", "false"]) == 0


def test_the_start_plan_is_cached_by_what_changes_memory(monkeypatch):
    cfg = load_config("tiny", overrides={"train.device": "cpu", "model.n_layer": "3"})
    first = memory_check.planned_need(cfg, "cpu")

    def no_planning(*args, **kwargs):
        raise AssertionError("planned again")

    monkeypatch.setattr("onegpu.plan.fixes.planned", no_planning)
    other_run = load_config("tiny", overrides={"train.device": "cpu", "model.n_layer": "3",
                                               "train.max_steps": "7", "out.dir": "elsewhere"})  # fmt: skip
    assert memory_check.planned_need(other_run, "cpu") == first
    with pytest.raises(AssertionError, match="planned again"):
        memory_check.planned_need(load_config("tiny", overrides={"model.n_layer": "4"}), "cpu")
    # another onegpu (its planner changed since the plan was cached) plans again
    monkeypatch.setattr(memory_check, "source_fingerprint", lambda: "another onegpu")
    with pytest.raises(AssertionError, match="planned again"):
        memory_check.planned_need(cfg, "cpu")


def test_a_cpus_auto_precision_keys_the_start_plan(monkeypatch):
    """`auto` precision on a CPU follows its measured peaks: a plan made for bf16 must not be
    served to a run that will train in fp32 (larger activations)."""
    from onegpu.techniques import precision

    monkeypatch.setattr(precision, "bf16_native", lambda device: True)
    # the kernel pinned: each plan would time its own, and a near-tie can pick a larger one
    over = {"train.device": "cpu", "model.n_layer": "3", "model.attention": "sdpa"}
    cfg = load_config("tiny", overrides=over)
    monkeypatch.setattr(precision, "cpu_bf16_speedup", lambda: 6.0)
    as_bf16 = memory_check.planned_need(cfg, "cpu")
    monkeypatch.setattr(precision, "cpu_bf16_speedup", lambda: 0.6)
    as_fp32 = memory_check.planned_need(cfg, "cpu")
    assert as_fp32["peak"] > as_bf16["peak"]


def test_a_configuration_the_planner_cannot_follow_is_one_line_and_the_run_starts(tmp_path, capsys):
    """Randomized linear layers read a value in their step, which fake tensors lack: the check
    says so in one line and the run trains (it used to end with a traceback)."""
    args = ["train", "--preset", "tiny", "--train.device", "cpu", "--train.max_steps", "1",
            "--optim.warmup_steps", "0", "--out.progress", "false",
            "--memory.randomized_linear", "0.25", "--out", str(tmp_path / "run")]  # fmt: skip
    assert main(args) == 0
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(
        "onegpu: memory check skipped: could not plan this configuration "
        "(DataDependentOutputException: "
    ), err
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["floor_s"] is None  # fake tensors cannot follow it either: said once, above


def test_any_planner_failure_skips_the_check_but_configuration_errors_are_raised(
    monkeypatch, capsys
):
    cfg = load_config("tiny", overrides={"train.device": "cpu", "model.init_std": "0.0123"})
    failures = [RuntimeError("no shape rule for aten.thing\nlong details"), ConfigError("x", "y")]

    def planner_fails(*args, **kwargs):
        raise failures.pop(0)

    monkeypatch.setattr("onegpu.plan.fixes.planned", planner_fails)
    assert memory_check.check_memory(cfg, CPU) == {
        "skipped": "could not plan this configuration (RuntimeError: no shape rule for aten.thing)"
    }
    assert capsys.readouterr().err.strip().splitlines() == [
        "onegpu: memory check skipped: could not plan this configuration "
        "(RuntimeError: no shape rule for aten.thing)"
    ]
    with pytest.raises(ConfigError, match="^x: y$"):
        memory_check.check_memory(cfg, CPU)


def test_a_kernel_this_device_lacks_is_the_builds_one_line_before_any_plan(monkeypatch):
    """The fake plan runs the CPU's shape rules, so the build's refusal of an SDPA kernel the
    device lacks is checked first: the user's error, not a planner failure."""

    def no_planning(*args, **kwargs):
        raise AssertionError("planned")

    monkeypatch.setattr("onegpu.plan.fixes.planned", no_planning)
    cfg = load_config("tiny", overrides={"train.device": "cpu", "model.attention": "efficient"})
    with pytest.raises(ConfigError, match="^model.attention: the SDPA 'efficient' kernel"):
        memory_check.check_memory(cfg, CPU)


@pytest.mark.slow  # plans a share of two processes
def test_each_torchrun_process_checks_its_own_share(monkeypatch):
    """Under torchrun a process plans its share of the batch and its FSDP shards, and checks it
    against its part of the memory the processes on this machine share."""
    cfg = load_config("tiny", overrides={"train.device": "cpu", "model.n_layer": "4"})
    alone = memory_check.planned_need(cfg, "cpu")
    share = memory_check.planned_need(cfg, "cpu", world_size=2)
    assert 0 < share["peak"] < alone["peak"]
    room = share["peak"] * 3
    monkeypatch.setattr(memory_check, "available_host_bytes", lambda: room)
    assert memory_check.check_memory(cfg, CPU, world_size=2, per_machine=2)["need"] == share
    with pytest.raises(ConfigError, match="train.skip_memory_check: the planner predicts"):
        memory_check.check_memory(cfg, CPU, world_size=2, per_machine=4)


# Every technique the README's commands show, each through the start-up check on this CPU.
README_TECHNIQUES = {
    "fp32": {"train.precision": "fp32"},
    "bf16-pure": {"train.precision": "bf16-pure"},
    "fp16": {"train.precision": "fp16"},
    "attn+mlp": {"memory.checkpointing": "attn+mlp"},
    "every:2": {"memory.checkpointing": "every:2"},
    "selective": {"memory.checkpointing": "selective"},
    "dots": {"memory.checkpointing": "dots"},
    "offload activations": {"memory.offload_activations": "true"},
    "offload optimizer": {"memory.offload_optimizer": "true"},
    "offload params": {"memory.offload_params": "true"},
    "offload dir": {"memory.offload_optimizer": "true", "memory.offload_dir": "{tmp}"},
    "loss chunk": {"memory.loss_chunk": "64"},
    "gelu 2 bits": {"memory.gelu_bits": "2"},
    "randomized linear": {"memory.randomized_linear": "0.25"},
    "adamw8bit": {"optim.name": "adamw8bit"},
    "adafactor": {"optim.name": "adafactor"},
    "in backward": {
        "optim.in_backward": "true",
        "optim.grad_clip": "0",
        "train.micro_batch_size": "8",
    },
    "compile regional": {"train.compile": "regional"},
    "attention flash": {"model.attention": "flash"},
}


@pytest.mark.parametrize("name", README_TECHNIQUES)
def test_every_readme_technique_goes_through_the_check(name, tmp_path, capsys):
    """The check compares a plan, or says in one line that it cannot plan this configuration,
    and the run starts; never a traceback for a run the user could have run."""
    over = {k: v.replace("{tmp}", str(tmp_path)) for k, v in README_TECHNIQUES[name].items()}
    cfg = load_config("tiny", overrides={"train.device": "cpu", **over})
    result = memory_check.check_memory(cfg, CPU)
    assert "need" in result or "skipped" in result
    if "skipped" in result:
        err = capsys.readouterr().err.strip().splitlines()
        assert err == [f"onegpu: memory check skipped: {result['skipped']}"]
    else:
        assert result["need"]["peak"] > 0
