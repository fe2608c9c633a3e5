"""The `onegpu` command preloads tcmalloc where the system has it, and can be told not to."""

import pytest


@pytest.mark.slow
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
