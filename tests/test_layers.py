"""Packages import one way, from the bottom up (the layers of docs/architecture.md)."""

from onegpu.tools import layers


def test_every_import_points_down_the_layers():
    edges = layers.package_imports()
    assert layers.violations(edges) == []
    # no two packages import each other (implied by strict layers, checked outright)
    for src, dsts in edges.items():
        for dst in dsts:
            assert src not in edges.get(dst, {}), (src, dst)


def test_every_package_has_a_layer():
    packages = {
        p.name for p in layers.ROOT.iterdir() if p.is_dir() and (p / "__init__.py").exists()
    }
    backends = {
        f"backends.{p.name}"
        for p in (layers.ROOT / "backends").iterdir()
        if p.is_dir()
        if (p / "__init__.py").exists()
    }
    modules = {p.stem for p in layers.ROOT.glob("*.py") if p.stem != "__init__"}
    assert packages | backends | modules == set(layers.LAYER_OF)


def test_the_checker_sees_a_wrong_way_import():
    edges = {"config": {"optim": {"onegpu.config"}}, "optim": {"config": {"onegpu.optim.factory"}}}
    found = layers.violations(edges)
    assert len(found) == 1 and found[0].startswith("config (layer 0) imports optim")


def test_no_import_circle_between_modules():
    """Modules never import each other, not even inside functions; KNOWN_CIRCLES (issue 29,
    temporary) lists today's, and each of its entries must still be one."""
    _, failures = layers.circle_report(layers.module_imports())
    assert failures == []


# A synthetic onegpu: plan imports fixes inside a function and fixes imports plan at import
# time (relatively): a circle; config.options imports tools upward inside a function; data
# imports optim upward and torch under TYPE_CHECKING; models.gpt imports torch, optim imports
# it; tools.plan imports torch inside a function only.
TREE = {
    "__init__.py": "",
    "config/__init__.py": "from .options import Options\n",
    "config/options.py": "class Options:\n    def plan(self):\n"
    "        from onegpu.tools.plan import report\n        return report()\n",
    "data/__init__.py": "from typing import TYPE_CHECKING\n\nif TYPE_CHECKING:\n"
    "    import torch\n    from onegpu.optim import GPT\n",
    "models/__init__.py": "",
    "models/gpt.py": "import torch\n\nGPT = torch.nn.Module\n",
    "optim/__init__.py": "from onegpu.models.gpt import GPT\n",
    "tools/__init__.py": "",
    "tools/plan.py": "from onegpu import models\n\n\ndef report():\n    import torch\n\n"
    "    from onegpu.tools.fixes import fixes_for\n\n    return fixes_for(torch)\n",
    "tools/fixes.py": "from .plan import report\n\n\ndef fixes_for(x):\n    return report\n",
}


def _tree(tmp_path):
    root = tmp_path / "onegpu"
    for rel, text in TREE.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    return root


def test_a_function_local_circle_is_found_and_named(tmp_path):
    root = _tree(tmp_path)
    graph = layers.module_imports(root)
    assert graph["onegpu.tools.fixes"] == {"onegpu.tools.plan": 1}  # relative, resolved
    assert graph["onegpu.tools.plan"] == {"onegpu.models": 1, "onegpu.tools.fixes": 7}
    assert layers.circles(graph) == [["onegpu.tools.fixes", "onegpu.tools.plan"]]
    lines, failures = layers.circle_report(graph, known={})
    assert (
        failures == lines == ["onegpu.tools.fixes:1 -> onegpu.tools.plan:7 -> onegpu.tools.fixes"]
    )
    allowed = {frozenset({"onegpu.tools.fixes", "onegpu.tools.plan"}): "moved in issue 29"}
    assert layers.circle_report(graph, allowed)[1] == []
    stale = {**allowed, frozenset({"onegpu.config", "onegpu.data"}): "moved in issue 29"}
    (failure,) = layers.circle_report(graph, stale)[1]
    assert "onegpu.config, onegpu.data, no longer a circle" in failure


def test_a_wider_circle_is_named_with_all_its_modules(tmp_path):
    root = _tree(tmp_path)
    (root / "config/__init__.py").write_text("from onegpu.data import y\n")
    (root / "config/options.py").write_text("from onegpu.data import y\n")
    (root / "data/__init__.py").write_text(
        "def f():\n    import onegpu.config\n    import onegpu.config.options\n"
    )
    graph = layers.module_imports(root)
    group = ["onegpu.config", "onegpu.config.options", "onegpu.data"]
    assert group in layers.circles(graph)
    line = layers.describe_circle(graph, group)
    assert (
        line
        == "onegpu.config:1 -> onegpu.data:2 -> onegpu.config (and through onegpu.config.options)"
    )


def test_function_local_and_type_checking_imports_count_for_the_layers(tmp_path):
    found = layers.violations(layers.package_imports(_tree(tmp_path)))
    assert found == [
        "config (layer 0) imports tools (layer 10) in onegpu.config.options",  # in a method
        "data (layer 2) imports optim (layer 6) in onegpu.data",  # under TYPE_CHECKING
    ]


def test_the_torch_free_marking_reads_import_time_imports_only(tmp_path):
    free = layers.torch_free_modules(_tree(tmp_path))
    assert {"onegpu.tools.plan", "onegpu.tools.fixes", "onegpu.data", "onegpu.config"} <= free
    assert "onegpu.models.gpt" not in free and "onegpu.optim" not in free  # directly; through gpt


def test_the_check_fails_naming_the_circle(tmp_path, capsys):
    assert layers.main(_tree(tmp_path), known={}) == 1
    out = capsys.readouterr().out
    assert "onegpu.tools.fixes:1 -> onegpu.tools.plan:7 -> onegpu.tools.fixes" in out
    assert "config (layer 0) imports tools (layer 10)" in out


LONG_ALLOWED: dict[str, str] = {}
"""'module' or 'module:function' -> the one-line reason it may exceed the limit (none today)."""


def test_modules_and_functions_stay_small():
    """No module in src/onegpu over 400 lines, no function over 60 (docs/architecture.md), as
    ruff formats them (CI checks the format: no line is squeezed to pass this test); a longer
    one is split by what it does, or named in LONG_ALLOWED with its reason."""
    import ast

    too_long = []
    for path in sorted(layers.ROOT.rglob("*.py")):
        text = path.read_text()
        rel = path.relative_to(layers.ROOT)
        assert "fmt: skip" not in text, f"{rel}: a line kept from the formatter"
        if text.count("\n") > 400 and str(rel) not in LONG_ALLOWED:
            too_long.append(f"{rel}: {text.count(chr(10))} lines")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = node.end_lineno - node.lineno + 1
                if n > 60 and f"{rel}:{node.name}" not in LONG_ALLOWED:
                    too_long.append(f"{rel}:{node.name}: {n} lines")
    assert too_long == []


# What a second backend shares: importable with no torch at all.
TORCH_FREE = [
    "onegpu.config",
    "onegpu.cache",
    "onegpu.data.sources",
    "onegpu.data.chat",
    "onegpu.data.examples",
    "onegpu.data.encode",
    "onegpu.data.tokenizer",
    "onegpu.data.tokens",
    "onegpu.data.splits",
    "onegpu.data.windows",
    "onegpu.runs.folder",
    "onegpu.runs.meter",
    "onegpu.runs.sinks",
    "onegpu.runs.signals",
    "onegpu.tools.plot",
]


def test_the_shared_layers_import_no_torch(tmp_path):
    """Imported in a fresh interpreter where `import torch` fails; the run folder, its sinks
    and the meter then work end to end."""
    import subprocess
    import sys

    script = f"""
import sys
sys.modules["torch"] = None  # any `import torch` now raises ImportError
import importlib
for name in {TORCH_FREE!r}:
    importlib.import_module(name)
from pathlib import Path
from onegpu.config import load_config
from onegpu.runs.folder import RunFolder
from onegpu.runs.meter import Meter

class Totals:
    def __init__(self): self.loss = 0.0
    def add(self, out): self.loss += out
    def read(self): return dict(loss_sum=self.loss, skipped=0, in_a_row=0, grad_norm=1.0, lr=0.1)
    def reset_interval(self): self.loss = 0.0
    def state_dict(self): return {{}}
    def load_state_dict(self, s): pass

cfg = load_config("tiny", overrides={{"out.tensorboard": "true"}})
run = RunFolder(Path({str(tmp_path)!r}) / "run", cfg)
meter = Meter(Totals(), flops_per_token=10, peak=None)
meter.add(2.0, 64); meter.add(4.0, 64)
run.log(meter.flush())
run.write_summary({{"loss": meter.loss}})
run.close()
assert "torch" not in sys.modules or sys.modules["torch"] is None
print("ok", meter.loss)
"""
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["ok", "3.0"]
    row = (tmp_path / "run" / "metrics.jsonl").read_text()
    assert '"loss": 3.0' in row and '"tokens_per_s"' in row
    assert any((tmp_path / "run" / "tensorboard").iterdir())


def test_what_both_backends_share_is_torch_free():
    """Statically, every module: the JAX backend and the packages it shares with torch (config,
    data, run folder, caches) load no torch when imported; the analysis does see torch."""
    free = layers.torch_free_modules()
    shared = ("config", "cache", "quiet", "runs", "data", "backends.jax", "cli")
    for path in layers.ROOT.rglob("*.py"):
        module = layers._module_name(path)
        if layers.package_of(module) in shared:
            assert module in free, f"{module} loads torch when imported"
    assert {"onegpu.perf.logits", "onegpu.perf.cpu", "onegpu.perf.peaks"} <= free
    assert "onegpu.models.gpt" not in free and "onegpu.backends.torch.backend" not in free
    assert "onegpu.techniques.chunked_loss" not in free  # via a torch-importing dependency too
