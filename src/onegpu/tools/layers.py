"""The package's layers and the imports between them: `python -m onegpu.tools.layers`.

onegpu's packages import one way, from the bottom up; a package may import only from layers
below its own (never from its own layer, so no two packages import each other). LAYERS lists
that order by hand: it is the design, checked against the imports, not computed from them.

The rules, over every import statement of every module (at import time, inside functions and
methods, under `if TYPE_CHECKING:`; relative ones resolved):
- no package imports one in its own layer or above (`violations`);
- no import circle between modules, within a package too (`circles`): modules that import each
  other only inside functions load fine today and hide a dependency that runs both ways;
- `*` marks what loads no torch, from import-time imports only (`torch_free_modules`): a
  torch import inside a function of a torch-free module (the CLI's commands) is how it stays so.
Prints the diagram with the imports actually found, any import that points the wrong way and
any circle; exits 1 if there is one. tests/test_layers.py runs it.
"""

from __future__ import annotations

import ast
import functools
import sys
from collections import defaultdict, deque
from pathlib import Path

LAYERS: list[tuple[str, ...]] = [
    ("config", "quiet"),  # pure data: options and their checks; library notes off
    ("cache",),  # where caches live (a write that fails is config's one-line error)
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

# TEMPORARY: today's import circles, allowed until the modules move (issue 29); empty it then.
# Each entry is a whole circle (every module in it); a circle that grows, a new one, or an entry
# no longer found fails the check. The reason says where it goes away.
KNOWN_CIRCLES: dict[frozenset[str], str] = {}


def package_of(module: str) -> str | None:
    """'onegpu.techniques.loss' -> 'techniques'; None for the package root or outside it."""
    parts = module.split(".")
    if parts[0] != "onegpu" or len(parts) < 2:
        return None
    if parts[1] == "backends" and len(parts) > 2:  # each backend is a layer unit of its own
        return f"backends.{parts[2]}"
    return parts[1]


def _module_name(path: Path, root: Path = ROOT) -> str:
    rel = path.relative_to(root.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _from_base(node: ast.ImportFrom, module: str, is_package: bool) -> str:
    """The module a `from ... import` reads from, a relative one resolved against `module`."""
    if not node.level:
        return node.module or ""
    parts = module.split(".")
    base = parts[: len(parts) - node.level + is_package]
    return ".".join(base + ([node.module] if node.module else []))


def _imported(tree: ast.AST, module: str, is_package: bool) -> set[str]:
    """Every dotted name the imports under `tree` may name ('from a import b': a and a.b)."""
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            target = _from_base(node, module, is_package)
            out.add(target)
            out.update(f"{target}.{alias.name}" for alias in node.names)
    return out


def _owning_module(name: str, modules: frozenset[str]) -> str | None:
    """'onegpu.tools.plan.fixes_for' -> 'onegpu.tools.plan': the longest prefix that is a module."""
    parts = name.split(".")
    for n in range(len(parts), 0, -1):
        if ".".join(parts[:n]) in modules:
            return ".".join(parts[:n])
    return None


def module_imports(root: Path = ROOT) -> dict[str, dict[str, int]]:
    """module -> each onegpu module it imports -> the first line that does. Every import counts:
    at import time, inside a function or method, and under `if TYPE_CHECKING:` too, since a
    type-only import is still a dependency (type checkers and readers follow it, and it is the
    usual way to hide a circle rather than remove it: a type both sides need belongs lower down,
    as models/protocol.py does). 'from a import b' names a.b where b is a module, else a."""
    modules = _all_modules(root)
    graph: dict[str, dict[str, int]] = {}
    for path in sorted(root.rglob("*.py")):
        module = _module_name(path, root)
        out = graph[module] = {}
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = _from_base(node, module, path.name == "__init__.py")
                names = [f"{base}.{alias.name}" for alias in node.names]
            else:
                continue
            for name in names:
                target = _owning_module(name, modules)
                if target is not None and target != module:
                    out[target] = min(out.get(target, node.lineno), node.lineno)
    return graph


def package_edges(graph: dict[str, dict[str, int]]) -> dict[str, dict[str, set[str]]]:
    """package -> imported package -> the modules that import it (from `module_imports`)."""
    edges: dict[str, dict[str, set[str]]] = defaultdict(lambda: defaultdict(set))
    for module, targets in graph.items():
        src = package_of(module)
        for target in targets:
            dst = package_of(target)
            if src is not None and dst is not None and dst != src:
                edges[src][dst].add(module)
    return edges


def package_imports(root: Path = ROOT) -> dict[str, dict[str, set[str]]]:
    """package -> imported package -> the modules that import it (every import statement)."""
    return package_edges(module_imports(root))


def _reach(graph: dict[str, dict[str, int]], start: str) -> set[str]:
    seen: set[str] = set()
    todo = [start]
    while todo:
        for nxt in graph.get(todo.pop(), {}):
            if nxt not in seen:
                seen.add(nxt)
                todo.append(nxt)
    return seen


def circles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """Every import circle between modules, as the modules in it (sorted): the groups whose
    modules each reach every other through imports (strongly connected, two or more)."""
    reach = {m: _reach(graph, m) for m in graph}
    found = {
        frozenset(o for o in reach[m] if m in reach.get(o, ())) for m in graph if m in reach[m]
    }
    return sorted(sorted(group) for group in found)


def _shortest_circle(graph: dict[str, dict[str, int]], group: list[str]) -> list[str]:
    """One shortest path from the group's first module back to it: [a, b, ..., a]."""
    start, prev = group[0], {}
    todo = deque([start])
    while todo:
        module = todo.popleft()
        for nxt in sorted(graph[module]):
            if nxt == start:
                path = [module]
                while path[-1] != start:
                    path.append(prev[path[-1]])
                return [*reversed(path), start]
            if nxt in group and nxt not in prev:
                prev[nxt] = module
                todo.append(nxt)
    raise ValueError(f"not a circle: {group}")


def describe_circle(graph: dict[str, dict[str, int]], group: list[str]) -> str:
    """'a:12 -> b:40 -> a': a imports b on its line 12, b imports a on its line 40; the
    group's other modules after it."""
    path = _shortest_circle(graph, group)
    steps = [f"{a}:{graph[a][b]}" for a, b in zip(path, path[1:])]
    rest = sorted(set(group) - set(path))
    return " -> ".join([*steps, path[-1]]) + (f" (and through {', '.join(rest)})" if rest else "")


def circle_report(
    graph: dict[str, dict[str, int]], known: dict[frozenset[str], str] = KNOWN_CIRCLES
) -> tuple[list[str], list[str]]:
    """(a line for each circle, the failures): a circle not in `known` fails, and so does a
    `known` entry no longer found (the allow-list only shrinks)."""
    lines, failures = [], []
    found = circles(graph)
    for group in found:
        reason = known.get(frozenset(group))
        line = describe_circle(graph, group) + (f"   [allowed for now: {reason}]" if reason else "")
        lines.append(line)
        if reason is None:
            failures.append(line)
    for group in sorted(sorted(g) for g in set(known) - {frozenset(g) for g in found}):
        line = f"KNOWN_CIRCLES lists {', '.join(group)}, no longer a circle: remove the entry"
        lines.append(line)
        failures.append(line)
    return lines, failures


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


def torch_free_modules(root: Path = ROOT) -> set[str]:
    """Modules whose import loads none of HEAVY, directly or through the onegpu modules (and
    their packages' __init__) it imports at import time: an import inside a function or under
    `if TYPE_CHECKING:` loads nothing when the module is imported, so it does not count here."""
    deps: dict[str, set[str]] = {}
    heavy: set[str] = set()
    for path in sorted(root.rglob("*.py")):
        module = _module_name(path, root)
        tree = ast.parse(path.read_text(), filename=str(path))
        wrapper = ast.Module(body=_import_time(tree), type_ignores=[])
        names = _imported(wrapper, module, path.name == "__init__.py")
        if any(n.split(".")[0] in HEAVY for n in names):
            heavy.add(module)
        parts = module.split(".")
        parents = {".".join(parts[:i]) for i in range(1, len(parts))}
        deps[module] = {n for n in names if n in _all_modules(root)} | parents
    changed = True
    while changed:
        changed = False
        for module, ds in deps.items():
            if module not in heavy and ds & heavy:
                heavy.add(module)
                changed = True
    return set(deps) - heavy


@functools.cache
def _all_modules(root: Path = ROOT) -> frozenset[str]:
    return frozenset(_module_name(p, root) for p in root.rglob("*.py"))


def violations(
    edges: dict[str, dict[str, set[str]]], layer_of: dict[str, int] = LAYER_OF
) -> list[str]:
    """Each package import that points sideways or up the layers (or names a package that has
    no layer), with the modules that make it."""
    found = []
    for src, dsts in sorted(edges.items()):
        for dst, modules in sorted(dsts.items()):
            if src not in layer_of or dst not in layer_of:
                where = ", ".join(sorted(modules))
                found.append(f"{src} -> {dst}: a package missing from LAYERS ({where})")
            elif layer_of[dst] >= layer_of[src]:
                found.append(
                    f"{src} (layer {layer_of[src]}) imports {dst} (layer {layer_of[dst]}) in "
                    + ", ".join(sorted(modules))
                )
    return found


def _torch_marks(pkg: str, free: set[str], root: Path = ROOT) -> tuple[str, str]:
    """(' *' where importing any of the package loads no torch, else ''; the torch-free modules
    where only some are)."""
    mods = sorted(m for m in _all_modules(root) if package_of(m) == pkg)
    if mods and all(m in free for m in mods):
        return " *", ""
    ok = [m.split(".", 2)[2] for m in mods if m in free and m.count(".") >= 2]
    return "", f"   [* {', '.join(ok)}]" if ok else ""


def diagram(edges: dict[str, dict[str, set[str]]], root: Path = ROOT) -> str:
    free = torch_free_modules(root)
    lines = [
        "onegpu layers, top to bottom; each imports only from the layers below it.",
        "* torch-free: importing it loads no torch (what the JAX backend runs on):",
        "",
    ]
    for i in reversed(range(len(LAYERS))):
        for pkg in LAYERS[i]:
            deps = ", ".join(sorted(edges.get(pkg, {}), key=lambda d: (-LAYER_OF.get(d, -1), d)))
            star, some = _torch_marks(pkg, free, root)
            lines.append(f"  {i}  {pkg + star:<13} -> {deps or '(no other onegpu package)'}{some}")
    return "\n".join(lines)


def main(root: Path = ROOT, known: dict[frozenset[str], str] = KNOWN_CIRCLES) -> int:
    graph = module_imports(root)
    edges = package_edges(graph)
    print(diagram(edges, root))
    bad = violations(edges)
    print("\nimports that point the wrong way: " + ("none" if not bad else ""))
    for line in bad:
        print(f"  {line}")
    lines, failures = circle_report(graph, known)
    print(
        "\nimport circles between modules (module:line imports the next): "
        + ("none" if not lines else "")
    )
    for line in lines:
        print(f"  {line}")
    return 1 if bad or failures else 0


if __name__ == "__main__":
    sys.exit(main())
