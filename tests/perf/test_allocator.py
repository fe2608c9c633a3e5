"""The host allocator: tcmalloc where the system has it, else the wheel's mimalloc, else glibc
tuned in-process; reported in summary.json and turned off by ONEGPU_ALLOCATOR=system."""

import json
import os
import subprocess
import sys

import pytest

from onegpu.config import ConfigError
from onegpu.perf import allocator


def _run_allocator(tmp_path, env_extra) -> str:
    out = tmp_path / f"run{len(list(tmp_path.iterdir()))}"
    env = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", allocator.ENV)}
    cmd = [sys.executable, "-m", "onegpu", "train", "--preset", "tiny", "--out", str(out)]
    cmd += ["--train.max_steps", "2", "--train.device", "cpu", "--out.progress", "false"]
    subprocess.run(cmd, env={**env, **env_extra}, check=True, capture_output=True)
    return json.loads((out / "summary.json").read_text())["allocator"]


@pytest.mark.slow
def test_the_command_runs_on_the_first_fast_allocator_found(tmp_path):
    expected = "tcmalloc" if allocator.find_tcmalloc() else "mimalloc"
    if sys.platform == "linux" and os.path.exists("/dev/nvidiactl"):
        expected = "system"
    assert _run_allocator(tmp_path, {}) == expected
    assert _run_allocator(tmp_path, {allocator.ENV: "system"}) == "system"
    assert _run_allocator(tmp_path, {allocator.ENV: "glibc-tuned"}) == "glibc-tuned"
    assert _run_allocator(tmp_path, {allocator.ENV: "mimalloc"}) == "mimalloc"


@pytest.mark.skipif(sys.platform != "linux", reason="the wheel ships a Linux library")
def test_the_wheel_brings_mimalloc_on_linux():
    lib = allocator.find_mimalloc()
    assert lib is not None and lib.endswith("libmimalloc.so") and os.path.isfile(lib)


def test_glibc_tuning_is_applied_in_process_and_can_be_turned_off():
    code = (
        "from onegpu.perf import allocator as a; print(a.apply(), a.apply(), a.active_allocator())"
    )
    env = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", allocator.ENV)}
    on = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    off = subprocess.run([sys.executable, "-c", code], env={**env, allocator.ENV: "system"},
                         capture_output=True, text=True)  # fmt: skip
    if sys.platform == "linux" and not os.path.exists("/dev/nvidiactl"):
        assert on.stdout.split() == ["glibc-tuned"] * 3
    assert off.stdout.split() == ["system"] * 3


@pytest.mark.skipif(not allocator._applies(), reason="preloads happen on Linux CPU machines only")
@pytest.mark.parametrize(("given", "want"), [(None, "-1"), ("250", "250")])
def test_mimalloc_is_preloaded_keeping_freed_pages(monkeypatch, given, want):
    """mimalloc never purges (what tcmalloc does by default) unless the user says otherwise."""
    seen = {}
    monkeypatch.setattr(os, "execve", lambda exe, argv, env: seen.update(env))
    for k in ("LD_PRELOAD", allocator._REEXECED, allocator.MIMALLOC_PURGE):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv(allocator.ENV, "mimalloc")
    monkeypatch.setattr(allocator, "_tuned", True)  # an earlier in-process run tuned glibc
    if given:
        monkeypatch.setenv(allocator.MIMALLOC_PURGE, given)
    allocator.maybe_reexec_with_fast_allocator(["train"])
    assert seen["LD_PRELOAD"].startswith(allocator.find_mimalloc())
    assert seen[allocator.MIMALLOC_PURGE] == want


def test_an_unknown_allocator_is_one_line_naming_the_variable_and_its_values(monkeypatch):
    """A misspelt ONEGPU_ALLOCATOR is refused (exit 2), not silently run as auto."""
    env = {**os.environ, allocator.ENV: "nosuch"}
    env.pop("LD_PRELOAD", None)
    cmd = [sys.executable, "-m", "onegpu", "train", "--preset", "tiny", "--train.max_steps", "1"]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
    err = done.stderr.strip().splitlines()
    assert done.returncode == 2 and len(err) == 1, done.stderr
    assert err[0].startswith(f"onegpu: error: {allocator.ENV}: unknown allocator 'nosuch'")
    assert all(choice in err[0] for choice in allocator.CHOICES)
    monkeypatch.setenv(allocator.ENV, "nosuch")  # library users calling onegpu.train too
    with pytest.raises(ConfigError, match=allocator.ENV):
        allocator.apply()
