"""benchmarks/what_if/sitecustomize.py makes the parts of a step that ONEGPU_WHAT_IF names free
in any process started with its folder on PYTHONPATH (step_cuts.py's `free-*` ablations)."""

import importlib.util
import os
import subprocess
import sys
import types
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


def _site_module(monkeypatch):
    """sitecustomize.py loaded as a module of its own, applying nothing."""
    spec = importlib.util.spec_from_file_location("what_if_site", WHAT_IF / "sitecustomize.py")
    module = importlib.util.module_from_spec(spec)
    monkeypatch.delenv("ONEGPU_WHAT_IF", raising=False)
    spec.loader.exec_module(module)
    return module


def test_gelu_and_layernorm_return_their_input():
    code = (
        "import torch, onegpu.models.gpt as gpt\n"
        "x = torch.randn(4, 8)\n"
        "assert gpt.TanhGELU()(x) is x\n"
        "assert gpt.LayerNorm(8)(x) is x\n"
    )
    done = _python(code, "gelu,layernorm")
    assert done.returncode == 0, done.stderr


def test_the_softmaxes_give_cheap_stand_ins_of_their_shape_and_dtype():
    code = (
        "import torch\n"
        "from onegpu.models import blocked_attention\n"
        "from onegpu.techniques import loss_kernel_cpu\n"
        "s = torch.randn(2, 3, 4, 4)\n"
        "p = blocked_attention.causal_softmax(s, 0, 0.5, torch.bfloat16)\n"
        "assert p.dtype == torch.bfloat16 and p.shape == s.shape\n"
        "assert p.equal((s * (0.5 / 4)).bfloat16())\n"
        "logits = torch.randn(4, 16, dtype=torch.bfloat16)\n"
        "t, v = torch.zeros(4, 1, dtype=torch.long), torch.ones(4, 1, dtype=torch.bool)\n"
        "loss, g = loss_kernel_cpu.softmax_grad(logits, t, v, 16, torch.bfloat16)\n"
        "assert loss.item() == 0 and g.dtype == torch.bfloat16 and g.shape == logits.shape\n"
        "assert not g.any()\n"
    )
    done = _python(code, "attention-softmax,loss-softmax")
    assert done.returncode == 0, done.stderr


@pytest.mark.parametrize(
    ("parts", "changed", "unchanged"),
    [
        ("gelu", "gpt.TanhGELU()", "gpt.LayerNorm(8)"),
        ("layernorm", "gpt.LayerNorm(8)", "gpt.TanhGELU()"),
    ],
)
def test_only_the_named_parts_change(parts, changed, unchanged):
    code = "import torch, onegpu.models.gpt as gpt\nx = torch.randn(4, 8)\n"
    code += f"assert {changed}(x) is x\nassert {unchanged}(x) is not x\n"
    done = _python(code, parts)
    assert done.returncode == 0, done.stderr


def test_a_patch_whose_target_moved_exits_instead_of_timing_the_step_whole(monkeypatch):
    """site.py prints and ignores a sitecustomize's exceptions; a renamed target must stop
    the process, not leave the step unablated under a what-if's name."""
    module = _site_module(monkeypatch)
    with pytest.raises(SystemExit, match="has no 'renamed' to replace"):
        module._replace(types.SimpleNamespace(), "renamed", None)


def test_step_cuts_give_a_what_if_to_its_own_cuts_only(monkeypatch):
    sys.path.insert(0, str(WHAT_IF.parent))
    import step_cuts

    sys.path.remove(str(WHAT_IF.parent))
    monkeypatch.setenv("ONEGPU_WHAT_IF", "gelu")  # left in the shell: must not ablate the base
    monkeypatch.setenv("PYTHONPATH", "/elsewhere")
    base = step_cuts.environment("blocked+regional+loss-compiled")
    assert "ONEGPU_WHAT_IF" not in base and base["PYTHONPATH"] == "/elsewhere"
    cut = step_cuts.environment("free-gelu+layernorm+optimizer")
    assert cut["ONEGPU_WHAT_IF"] == "gelu,layernorm,optimizer"
    assert cut["PYTHONPATH"].split(os.pathsep) == [str(WHAT_IF), "/elsewhere"]
    fast = step_cuts.environment("fast-exp")
    assert fast["ONEGPU_WHAT_IF"] == "exp_u20" and fast["TORCHINDUCTOR_FX_GRAPH_CACHE"] == "0"
    asked = {p for c in step_cuts.CUT_ENV.values() for p in c.get("ONEGPU_WHAT_IF", "").split(",")}
    assert (
        asked - {""} <= set(_site_module(monkeypatch).PARTS)
        and step_cuts.CUTS["free-gelu"][0] == step_cuts.AUTO_FLAGS
    )


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


def test_part_costs_read_each_part_and_each_chain_from_the_turns():
    """Cycle by cycle: the cut a what-if ablates from, less the what-if."""
    sys.path.insert(0, str(WHAT_IF.parent))
    import step_cuts

    sys.path.remove(str(WHAT_IF.parent))
    steps = {
        "blocked+regional+loss-compiled": 0.400,
        "free-gelu": 0.370,
        "free-gelu+layernorm": 0.350,
    }
    runs = {
        cut: [{"turns": [[s + 0.001 * c, s + 0.001 * c + 0.5, s + 0.001 * c] for c in range(12)]}]
        for cut, s in steps.items()
    }  # each turn's median is its first step: the 0.5 s outlier in the middle changes nothing
    text = step_cuts.part_costs(runs)
    assert "| free-gelu | blocked+regional+loss-compiled | 30.0 ms (30.0 to 30.0) |" in text
    assert "| free-gelu+layernorm | free-gelu | 20.0 ms (20.0 to 20.0) |" in text
    assert (
        "| free-gelu+layernorm | blocked+regional+loss-compiled | 50.0 ms (50.0 to 50.0) |" in text
    )
    assert step_cuts.part_costs({"base": runs["free-gelu"]}) == ""
    assert step_cuts.ablated_from("fast-exp") == "blocked+regional+loss-compiled"
    assert step_cuts.ablated_from("glibc") is None
