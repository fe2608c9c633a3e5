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
        f"backends.{p.name}" for p in (layers.ROOT / "backends").iterdir() if p.is_dir()
        if (p / "__init__.py").exists()
    }
    modules = {p.stem for p in layers.ROOT.glob("*.py") if p.stem != "__init__"}
    assert packages | backends | modules == set(layers.LAYER_OF)


def test_the_checker_sees_a_wrong_way_import():
    edges = {"config": {"build": {"onegpu.config"}}, "build": {"config": {"onegpu.backends.torch.build"}}}
    found = layers.violations(edges)
    assert len(found) == 1 and found[0].startswith("config (layer 0) imports build")


def test_modules_and_functions_stay_small():
    """No module in src/onegpu over 400 lines, no function over 60 (docs/architecture.md)."""
    import ast

    too_long = []
    for path in sorted(layers.ROOT.rglob("*.py")):
        text = path.read_text()
        rel = path.relative_to(layers.ROOT)
        if text.count("\n") > 400:
            too_long.append(f"{rel}: {text.count(chr(10))} lines")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = node.end_lineno - node.lineno + 1
                if n > 60:
                    too_long.append(f"{rel}:{node.name}: {n} lines")
    assert too_long == []


# What a second backend shares: importable with no torch at all.
TORCH_FREE = [
    "onegpu.config",
    "onegpu.cache",
    "onegpu.data.corpus",
    "onegpu.data.tokenizer",
    "onegpu.data.tokens",
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
    assert "onegpu.models.gpt" not in free and "onegpu.backends.torch.trainer" not in free
    assert "onegpu.techniques.chunked_loss" not in free  # via a torch-importing dependency too
