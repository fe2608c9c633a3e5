"""benchmarks/what_if/sitecustomize.py makes the parts of a step that ONEGPU_WHAT_IF names free
in any process started with its folder on PYTHONPATH (step_cuts.py's `free-*` ablations)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
from safetensors.torch import load_file

WHAT_IF = Path(__file__).resolve().parents[2] / "benchmarks" / "what_if"


def _env(parts: str) -> dict[str, str]:
    return {**os.environ, "ONEGPU_WHAT_IF": parts, "PYTHONPATH": str(WHAT_IF)}


def _python(code: str, parts: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", code], env=_env(parts), capture_output=True, text=True
    )


def test_gelu_and_layernorm_return_their_input():
    code = (
        "import torch, onegpu.models.gpt as gpt\n"
        "x = torch.randn(4, 8)\n"
        "assert gpt.TanhGELU()(x) is x and gpt.tanh_gelu_sigmoid_form(x) is x\n"
        "assert gpt.LayerNorm(8)(x) is x\n"
    )
    done = _python(code, "gelu,layernorm")
    assert done.returncode == 0, done.stderr


def test_only_the_named_parts_change():
    code = "import torch, onegpu.models.gpt as gpt\nx = torch.randn(4, 8)\n"
    code += "assert gpt.TanhGELU()(x) is x\nassert gpt.LayerNorm(8)(x) is not x\n"
    done = _python(code, "gelu")
    assert done.returncode == 0, done.stderr


def test_exp_u20_puts_atens_faster_exponential_in_inductors_cpu_kernels():
    code = (
        "from torch._inductor.codegen.cpp import CppVecOverrides as ops\n"
        "assert ops.exp('v') == 'v.exp_u20()', ops.exp('v')\n"
        "assert 'v.neg().exp_u20()' in ops.sigmoid('v'), ops.sigmoid('v')\n"
    )
    done = _python(code, "exp_u20")
    assert done.returncode == 0, done.stderr


@pytest.mark.slow  # two tiny trainings, ~10 s
def test_a_free_optimizer_leaves_the_weights_as_they_started(tmp_path):
    """One step or three, the saved weights are the same: nothing was stepped."""
    weights = []
    for steps in (1, 3):
        out = tmp_path / f"run{steps}"
        cmd = [sys.executable, "-m", "onegpu", "train", "--preset", "tiny",
               "--train.max_steps", str(steps), "--train.eval_every", "0",
               "--out.dir", str(out), "--out.progress", "false"]  # fmt: skip
        done = subprocess.run(cmd, env=_env("optimizer"), capture_output=True, text=True)
        assert done.returncode == 0, done.stderr[-2000:]
        weights.append(load_file(out / "model.safetensors"))
    assert weights[0].keys() == weights[1].keys()
    assert all(weights[0][k].equal(weights[1][k]) for k in weights[0])


def test_an_unknown_part_is_refused_by_name():
    done = _python("pass", "gelu,softmax")
    assert done.returncode != 0
    assert "ONEGPU_WHAT_IF: unknown part(s) ['softmax']" in done.stderr
