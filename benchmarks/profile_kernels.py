"""What the non-matmul part of a profiled step is made of, by kernel: a reading of the
trace.json `onegpu profile` writes.

    onegpu profile <the run's flags> --out prof
    python benchmarks/profile_kernels.py prof [--top 12] [--callers aten::_softmax,aten::add]

`onegpu profile`'s summary groups inductor's kernels into one line ("compiled kernels"); under
the Python tracer they all show as `<built-in function kernel>`. This names each one: it reads
the generated module each kernel was called from (its path is in the caller's frame name),
lists the kernels that module's `call` launches in order, and matches them to the launches in
the trace. Also: the operands ATen's batched matmul copied (`aten::bmm > aten::contiguous >
aten::clone`, by shape) and what called `aten::copy_`; with `--callers`, what called each of
those ops (the last Python frames above it: `--callers aten::_softmax,aten::add`). Times are
per profiled step, in ms, the profiler's own (slower than an unprofiled step). Prints markdown.
"""

from __future__ import annotations

import argparse
import collections
import json
import re
from pathlib import Path

KERNEL = "<built-in function kernel>"


def load(folder: Path) -> tuple[list[dict], int]:
    trace = json.loads((folder / "trace.json").read_text())
    events = [e for e in trace["traceEvents"] if e.get("ph") == "X"]
    steps = sum(1 for e in events if re.fullmatch(r"ProfilerStep#\d+", e["name"])) or 1
    return events, steps


def stacks(events: list[dict]):
    """Each event with the events enclosing it on its thread (outermost first)."""
    threads = collections.defaultdict(list)
    for e in events:
        threads[(e["pid"], e["tid"])].append(e)
    for evs in threads.values():
        evs.sort(key=lambda e: (e["ts"], -e["dur"]))
        stack: list[dict] = []
        for e in evs:
            while stack and stack[-1]["ts"] + stack[-1]["dur"] <= e["ts"]:
                stack.pop()
            yield e, stack
            stack.append(e)


def launched(module_path: str) -> list[str]:
    """The kernels a generated module's `call` launches, in order."""
    src = Path(module_path).read_text()
    return re.findall(r"^\s+(cpp_fused_\w+|triton_\w+)\(", src[src.index("def call(") :], re.M)


def inductor_kernels(events: list[dict]) -> collections.Counter:
    by_id = {e["args"]["Python id"]: e for e in events if "Python id" in e.get("args", {})}
    per_module = collections.defaultdict(list)
    for e in events:
        if e["name"] == KERNEL:
            caller = by_id.get(e["args"].get("Python parent id"), {}).get("name", "")
            module = caller.split("(")[0]
            per_module[module].append(e)
    total: collections.Counter = collections.Counter()
    for module, launches in per_module.items():
        path = next((p for p in Path("/tmp").glob(f"torchinductor_*/*/{Path(module).name}")), None)
        names = launched(str(path)) if path else []
        launches.sort(key=lambda e: e["ts"])
        for i, e in enumerate(launches):
            name = names[i % len(names)] if names else f"{Path(module).name}[{i}]"
            total[name] += e["dur"]
    return total


def copies(events: list[dict]) -> tuple[collections.Counter, collections.Counter]:
    bmm_copies: collections.Counter = collections.Counter()
    copy_callers: collections.Counter = collections.Counter()
    for e, stack in stacks(events):
        names = [s["name"] for s in stack]
        if e["name"] == "aten::clone" and names[-2:] == ["aten::bmm", "aten::contiguous"]:
            args = stack[-2].get("args", {})
            bmm_copies[str(args.get("Input Dims"))] += e["dur"]
        if e["name"] == "aten::copy_":
            callers = [n for n in names if not n.startswith("aten::copy")][-2:]
            copy_callers[" > ".join(n[:48] for n in callers)] += e["dur"]
    return bmm_copies, copy_callers


def callers(events: list[dict], ops: set[str]) -> collections.Counter:
    """Time of each of `ops` by the op and the last three frames above it that are not ATen's."""
    found: collections.Counter = collections.Counter()
    for e, stack in stacks(events):
        if e["name"] in ops:
            frames = [s["name"][:60] for s in stack if not s["name"].startswith("aten::")][-3:]
            found[f"{e['name']} < " + " > ".join(frames)] += e["dur"]
    return found


def section(title: str, counts: collections.Counter, steps: int, top: int) -> str:
    lines = [f"## {title}", "", "| ms a step | what |", "|---|---|"]
    for name, us in counts.most_common(top):
        lines.append(f"| {us / steps / 1e3:.2f} | `{name}` |")
    total = sum(counts.values()) / steps / 1e3
    return "\n".join([*lines, f"| {total:.2f} | all |", ""])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("folder", type=Path, help="the --out folder of `onegpu profile`")
    ap.add_argument("--top", type=int, default=12)
    ap.add_argument("--callers", default="", help="comma-separated ops whose callers to list")
    a = ap.parse_args()
    events, steps = load(a.folder)
    bmm_copies, copy_callers = copies(events)
    print(f"# Kernels of {a.folder} ({steps} profiled steps)\n")
    print(section("Inductor's kernels", inductor_kernels(events), steps, a.top))
    print(section("Operands the batched matmul copied (shapes)", bmm_copies, steps, a.top))
    print(section("What called aten::copy_", copy_callers, steps, a.top))
    if a.callers:
        ops = set(a.callers.split(","))
        print(section(f"What called {', '.join(sorted(ops))}", callers(events, ops), steps, a.top))


if __name__ == "__main__":
    main()
