"""The package's layers and the imports between them: `python -m onegpu.tools.layers`.

onegpu's packages import one way, from the bottom up; a package may import only from layers
below its own (never from its own layer, so no two packages import each other). Every import
statement counts, those inside functions too. Prints the diagram with the imports actually found
and any import that points the wrong way; exits 1 if there is one. tests/test_layers.py runs it.
"""

from __future__ import annotations

import ast
import functools
import sys
from collections import defaultdict
from pathlib import Path

LAYERS: list[tuple[str, ...]] = [
    ("config", "cache", "quiet"),  # pure data: options, where caches live; library notes off
    ("perf", "memory", "runs", "data"),  # FLOPs, peaks, allocator; saved/live bytes; the run
    # lifecycle (folder, loop, checkpoints: no framework); corpus, tokens, windows, loaders
    ("models",),  # architecture
    ("techniques", "distributed"),  # over a built model; FSDP/DDP/DCP
    ("offload",),  # where bytes live: host optimizer, disk tier, weights, activations, pricing
    ("optim",),  # optimizers (the host optimizer among them)
    ("backends", "backends.torch", "backends.jax"),  # build, step, state <-> bytes per framework
    ("plan",),  # the fake-tensor planner over the torch build; fixes, largest, start-up check
    ("train",),  # the one entry: a backend (and its memory check) through the run lifecycle
    ("tools",),  # the commands: tune, bench, profile, info, export
    ("cli",),  # argument parsing -> commands
    ("__main__",),  # `python -m onegpu`
]
LAYER_OF = {pkg: i for i, layer in enumerate(LAYERS) for pkg in layer}
ROOT = Path(__file__).resolve().parents[1]  # src/onegpu


def package_of(module: str) -> str | None:
    """'onegpu.techniques.loss' -> 'techniques'; None for the package root or outside it."""
    parts = module.split(".")
    if parts[0] != "onegpu" or len(parts) < 2:
        return None
    if parts[1] == "backends" and len(parts) > 2:  # each backend is a layer unit of its own
        return f"backends.{parts[2]}"
    return parts[1]


def _module_name(path: Path) -> str:
    rel = path.relative_to(ROOT.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _imported(tree: ast.AST, module: str, is_package: bool) -> set[str]:
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: resolve against this module's package
                base = module.split(".")[: len(module.split(".")) - node.level + is_package]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            out.add(target)
            out.update(f"{target}.{alias.name}" for alias in node.names)
    return out


def package_imports() -> dict[str, dict[str, set[str]]]:
    """package -> imported package -> the modules that import it."""
    edges: dict[str, dict[str, set[str]]] = defaultdict(lambda: defaultdict(set))
    for path in sorted(ROOT.rglob("*.py")):
        module = _module_name(path)
        src = package_of(module)
        if src is None:
            continue
        tree = ast.parse(path.read_text(), filename=str(path))
        for target in _imported(tree, module, path.name == "__init__.py"):
            dst = package_of(target)
            known = bool(dst) and ((ROOT / dst.replace(".", "/")).is_dir() or (ROOT / f"{dst}.py").exists())
            if known and dst != src:
                edges[src][dst].add(module)
    return edges


HEAVY = ("torch", "transformers", "torchao")
"""What the torch-free part (config, data, run folder, the JAX backend) never loads."""


def _import_time(tree: ast.Module) -> list[ast.stmt]:
    """Statements that run when the module is imported: not function bodies, not
    `if TYPE_CHECKING:` blocks."""
    out, todo = [], list(tree.body)
    while todo:
        node = todo.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            todo.extend(node.orelse)
            continue
        out.append(node)
        for field in ("body", "orelse", "finalbody", "handlers"):
            todo.extend(getattr(node, field, []) or [])
    return out


def torch_free_modules() -> set[str]:
    """Modules whose import loads none of HEAVY, directly or through the onegpu modules (and
    their packages' __init__) it imports at import time."""
    deps: dict[str, set[str]] = {}
    heavy: set[str] = set()
    for path in sorted(ROOT.rglob("*.py")):
        module = _module_name(path)
        tree = ast.parse(path.read_text(), filename=str(path))
        wrapper = ast.Module(body=_import_time(tree), type_ignores=[])
        names = _imported(wrapper, module, path.name == "__init__.py")
        if any(n.split(".")[0] in HEAVY for n in names):
            heavy.add(module)
        parts = module.split(".")
        parents = {".".join(parts[:i]) for i in range(1, len(parts))}
        deps[module] = {n for n in names if n in _all_modules()} | parents
    changed = True
    while changed:
        changed = False
        for module, ds in deps.items():
            if module not in heavy and ds & heavy:
                heavy.add(module)
                changed = True
    return set(deps) - heavy


@functools.cache
def _all_modules() -> frozenset[str]:
    return frozenset(_module_name(p) for p in ROOT.rglob("*.py"))


def violations(edges: dict[str, dict[str, set[str]]]) -> list[str]:
    found = []
    for src, dsts in sorted(edges.items()):
        for dst, modules in sorted(dsts.items()):
            if src not in LAYER_OF or dst not in LAYER_OF:
                where = ", ".join(sorted(modules))
                found.append(f"{src} -> {dst}: a package missing from LAYERS ({where})")
            elif LAYER_OF[dst] >= LAYER_OF[src]:
                found.append(
                    f"{src} (layer {LAYER_OF[src]}) imports {dst} (layer {LAYER_OF[dst]}) in "
                    + ", ".join(sorted(modules))
                )
    return found


def _torch_marks(pkg: str, free: set[str]) -> tuple[str, str]:
    """(' *' where importing any of the package loads no torch, else ''; the torch-free modules
    where only some are)."""
    mods = sorted(m for m in _all_modules() if package_of(m) == pkg)
    if mods and all(m in free for m in mods):
        return " *", ""
    ok = [m.split(".", 2)[2] for m in mods if m in free and m.count(".") >= 2]
    return "", f"   [* {', '.join(ok)}]" if ok else ""


def diagram(edges: dict[str, dict[str, set[str]]]) -> str:
    free = torch_free_modules()
    lines = ["onegpu layers, top to bottom; each imports only from the layers below it.",
             "* torch-free: importing it loads no torch (what the JAX backend runs on):", ""]  # fmt: skip
    for i in reversed(range(len(LAYERS))):
        for pkg in LAYERS[i]:
            deps = ", ".join(sorted(edges.get(pkg, {}), key=lambda d: (-LAYER_OF.get(d, -1), d)))
            star, some = _torch_marks(pkg, free)
            lines.append(f"  {i}  {pkg + star:<13} -> {deps or '(no other onegpu package)'}{some}")
    return "\n".join(lines)


def main() -> int:
    edges = package_imports()
    print(diagram(edges))
    bad = violations(edges)
    print("\nimports that point the wrong way: " + ("none" if not bad else ""))
    for line in bad:
        print(f"  {line}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
