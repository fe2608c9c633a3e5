"""`train.xla_flags` on JAX: XLA's CPU options chosen by timing each in a process of its own,
for long runs only, cached; set in XLA_FLAGS before XLA starts (backends/jax/xla_flags.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("jax")

from onegpu.backends.jax import xla_flags  # noqa: E402
from onegpu.config import ConfigError, load_config  # noqa: E402


def _cfg(**over):
    return load_config("tiny", overrides={"train.backend": "jax", **over})


@pytest.mark.parametrize(
    ("step_s", "choice"),
    [
        ({"none": 1.0, "onednn": 0.94, "ynn-dot": 1.5}, "onednn"),
        ({"none": 1.0, "onednn": 0.97, "ynn-dot": 1.5}, "none"),  # under MIN_GAIN: defaults
        ({"none": 1.0, "onednn": None, "ynn-dot": 0.90}, "ynn-dot"),  # a failed trial is out
        ({"none": None, "onednn": 0.5, "ynn-dot": 0.5}, "none"),  # nothing to compare with
    ],
)
def test_a_setting_replaces_xlas_defaults_only_where_its_step_is_5_percent_faster(step_s, choice):
    assert xla_flags.choose(step_s) == choice


def test_auto_times_long_runs_once_and_short_runs_take_the_cached_choice(monkeypatch, tmp_path):
    monkeypatch.setenv("ONEGPU_CACHE", str(tmp_path))
    monkeypatch.delenv("XLA_FLAGS", raising=False)
    monkeypatch.setattr(xla_flags, "_accelerator_plugin", lambda: False)
    monkeypatch.setattr(xla_flags, "xla_started", lambda: False)  # as in a new `onegpu train`
    timed = []

    def measure(cfg):
        timed.append(cfg.train.max_steps)
        return {"choice": "onednn", "step_s": {"none": 1.0, "onednn": 0.9, "ynn-dot": 1.2}}

    def failed(cfg):  # XLA's defaults failed to run: not kept, timed again next time
        timed.append(-1)
        return {"choice": "none", "step_s": {"none": None, "onednn": None, "ynn-dot": None}}

    monkeypatch.setattr(xla_flags, "measure_settings", failed)
    short = xla_flags.decide(_cfg(**{"train.max_steps": "50"}))
    assert (short.setting, timed) == ("none", [])  # nothing cached yet: XLA's defaults, untimed
    long = xla_flags.decide(_cfg(**{"train.max_steps": str(xla_flags.MIN_STEPS)}))
    assert (long.setting, timed) == ("none", [-1])
    timed.clear()
    monkeypatch.setattr(xla_flags, "measure_settings", measure)
    long = xla_flags.decide(_cfg(**{"train.max_steps": str(xla_flags.MIN_STEPS)}))
    assert (long.setting, long.reason, timed) == ("onednn", "auto: timed", [xla_flags.MIN_STEPS])
    again = xla_flags.decide(_cfg(**{"train.max_steps": "50"}))
    assert (again.setting, again.reason) == ("onednn", "cached")
    assert "onednn 900.0 ms" in again.line()
    other_shape = xla_flags.decide(_cfg(**{"train.max_steps": "50", "train.micro_batch_size": "2"}))
    assert other_shape.setting == "none"  # another shape: its own entry, not timed yet
    monkeypatch.setenv("XLA_FLAGS", "--xla_cpu_use_thunk_runtime=true")
    mine = xla_flags.decide(_cfg(**{"train.max_steps": "50"}))
    assert (mine.setting, mine.reason) == ("none", "XLA_FLAGS set before the run")
    assert timed == [xla_flags.MIN_STEPS]
    assert xla_flags.decide(_cfg(**{"train.xla_flags": "ynn-dot"})).setting == "ynn-dot"


def test_flags_are_set_before_xla_starts_and_refused_after(monkeypatch):
    """In a fresh process the chosen flags reach XLA_FLAGS and XLA starts with them; in one
    where XLA has started already they could not take effect, so they are refused."""
    code = (
        "from onegpu.backends.jax.xla_flags import apply_xla_flags\n"
        "from onegpu.config import load_config\n"
        "import jax, json, os\n"
        "cfg = load_config('tiny', overrides={'train.backend': 'jax', 'train.xla_flags': 'onednn'})\n"
        "cfg, decided = apply_xla_flags(cfg)\n"
        "jax.devices()\n"
        "print(json.dumps([cfg.train.xla_flags, os.environ['XLA_FLAGS']]))\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-2000:]
    assert json.loads(out.stdout.splitlines()[-1]) == ["onednn", "--xla_cpu_use_onednn=true"]

    import jax

    jax.devices()  # XLA started in this process
    monkeypatch.delenv("XLA_FLAGS", raising=False)
    with pytest.raises(ConfigError, match="train.xla_flags"):
        xla_flags.apply_xla_flags(_cfg(**{"train.xla_flags": "onednn"}))
    assert "XLA_FLAGS" not in os.environ
    # a second run in the process, whose flags XLA already has (a resume keeps the setting)
    monkeypatch.setenv("XLA_FLAGS", "--xla_cpu_use_onednn=true")
    cfg, _ = xla_flags.apply_xla_flags(_cfg(**{"train.xla_flags": "onednn"}))
    assert (cfg.train.xla_flags, os.environ["XLA_FLAGS"]) == ("onednn", "--xla_cpu_use_onednn=true")
    monkeypatch.delenv("XLA_FLAGS")
    cfg, decided = xla_flags.apply_xla_flags(_cfg(**{"train.xla_flags": "none"}))
    assert (cfg.train.xla_flags, decided.reason) == ("none", "set")
    # auto neither times nor fails where it is too late: XLA's flags stay as they are
    cfg, decided = xla_flags.apply_xla_flags(_cfg(**{"train.max_steps": "5000"}))
    assert (cfg.train.xla_flags, decided.reason) == ("none", "XLA started before the run")
    assert "XLA_FLAGS" not in os.environ


@pytest.mark.slow  # three short JAX runs, each in a process of its own: ~25 s
def test_each_setting_is_timed_in_a_run_of_its_own(monkeypatch, tmp_path):
    monkeypatch.setenv("ONEGPU_CACHE", str(tmp_path))
    monkeypatch.delenv("XLA_FLAGS", raising=False)
    found = xla_flags.measure_settings(_cfg(**{"train.max_steps": "5000"}))
    assert set(found["step_s"]) == set(xla_flags.XLA_CPU_SETTINGS)
    assert all(s and 0 < s < 5 for s in found["step_s"].values())
    assert found["choice"] == xla_flags.choose(found["step_s"])
