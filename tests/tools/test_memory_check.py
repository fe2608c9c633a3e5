"""`onegpu train` plans before it allocates: a run that cannot fit is refused at once (exit 2,
the planner's figure and fixes, nothing written); the plan is cached per configuration."""

import pytest

from onegpu.cli import main
from onegpu.config import load_config
from onegpu.plan import startup as memory_check


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
