"""`onegpu profile`: a few real training steps under torch.profiler, and where time and memory go.

Writes (names are a contract, scripts rely on them):
- DIR/trace.json    Chrome/Perfetto trace; steps are `ProfilerStep#N`, phases `data`,
                    `forward`, `backward`, `optimizer` (record_function annotations of backends/torch/step.py);
- DIR/memory.html   memory timeline of the profiled steps, stacked by kind (params, grads,
                    optimizer state, activations, other), as Lippe's profiling tutorial and
                    "Optimising the Training Loop" show them; the
                    same plot as DIR/memory.png;
- DIR/summary.txt   phase times, top operations by time and by memory, idle gaps between
                    steps, and host-device synchronisations found;
- DIR/memory_snapshot.pickle (CUDA only) for https://pytorch.org/memory_viz, and
  DIR/memory_peak.json: the recorded window's highest allocated total and what was alive then,
  summed by the line of onegpu's code that allocated it (memory/snapshot.py; also in summary.txt).
"""

from __future__ import annotations

import base64
import json
import pickle
import statistics
import time
from pathlib import Path
from typing import Any

import torch
from torch._subclasses.fake_tensor import DataDependentOutputException

from onegpu.backends.torch.batches import training_batches
from onegpu.backends.torch.build import Built, build, processes
from onegpu.backends.torch.floor import checked_floor
from onegpu.config import Config, ConfigError
from onegpu.memory.breakdown import GROUPS, memory_timeline, profiling
from onegpu.memory.snapshot import format_peak, peak_allocations
from onegpu.perf.devices import sync
from onegpu.perf.floor import Floor, is_attention_name, is_gemm_name
from onegpu.runs.atomic import atomic_path, write_text_atomic
from onegpu.runs.folder import resolve_out_dir
from onegpu.runs.lock import release_run_folder

PHASES = ("data", "forward", "backward", "optimizer")
COMPILED_KERNEL = {"<built-in function kernel>": "compiled kernels (inductor, C++)"}
"""How the profiler names a kernel inductor generated on a CPU, and how the summary names it."""
NO_FLOOR = (
    "\nmatmul floor: not measured (the step reads a value, as randomized layers do, which "
    "fake tensors cannot follow)\n"
)
# Ops that make the host wait for the device (on CUDA); on CPU they are counted all the same,
# because the same code then stalls a GPU.
SYNC_OPS = (
    "aten::item",
    "aten::_local_scalar_dense",
    "cudaDeviceSynchronize",
    "cudaStreamSynchronize",
    "cudaEventSynchronize",
)


def profile(cfg: Config, *, steps: int = 3, warmup: int = 2) -> dict[str, Any]:
    """Run warmup + steps training steps, profile the last `steps`; write the files."""
    if steps < 1:
        raise ConfigError("--steps", f"must be at least 1 profiled step, got {steps}")
    if warmup < 0:
        raise ConfigError("--warmup", f"must be >= 0, got {warmup}")
    out = resolve_out_dir(cfg.out)
    with processes(cfg) as ctx:
        try:
            built = build(cfg, dist_ctx=ctx)
        except BaseException:  # refused: the folder it made goes again
            release_run_folder(out, unused=True)
            raise
        return _profiled(built, out, steps, warmup)


def _profiled(built: Built, out: Path, steps: int, warmup: int) -> dict[str, Any]:
    """Profile the built run's steps and write the files into `out`."""
    batches = training_batches(built)
    cuda = built.device.type == "cuda"
    if cuda:
        # Python stacks: what memory_peak.json names; C++ frames would cost seconds to symbolize
        torch.cuda.memory._record_memory_history(max_entries=200_000, stacks="python")
    built.model.train()

    def one_step(step: int) -> None:
        with torch.profiler.record_function("data"):
            x, y, n_tokens, positions = next(batches)
        built.step(x, y, n_tokens, step, positions)

    for step in range(warmup):  # compilation, allocator growth, optimizer state creation
        one_step(step)
    measured_s = _unprofiled_step_s(one_step, warmup, steps, built.device)
    start = warmup + steps
    with profiling(built.device) as prof:
        for step in range(start, start + steps):
            # our own step spans: torch's ProfilerStep#N needs a schedule, which clears events
            with torch.profiler.record_function(f"ProfilerStep#{step}"):
                one_step(step)
    peak_part = _recorded_peak(built.device, out) if cuda else ""

    prof.export_chrome_trace(str(out / "trace.json"))
    trace = json.loads((out / "trace.json").read_text())
    times, groups = memory_timeline(prof, built.device)
    # the trace's ts are us after baseTimeNanoseconds; the memory timeline's are epoch us
    base_us = trace.get("baseTimeNanoseconds", 0) / 1e3
    step_bounds = [(a + base_us, b + base_us) for a, b in _step_spans(trace)]
    _plot_memory(times, groups, step_bounds, out)
    try:
        floor = checked_floor(built.cfg, built.device, measured_s)
        floor_part = floor_text(prof, trace, floor, measured_s, cuda)
    except DataDependentOutputException:  # a value read in the step: fake tensors stop there
        floor, floor_part = None, NO_FLOOR
    text = summary_text(prof, trace, built, steps, cuda, floor_part) + peak_part
    write_text_atomic(out / "summary.txt", text)
    return {
        "out_dir": str(out),
        "summary": text,
        "floor_s": floor.seconds if floor else None,
        "step_s": measured_s,
        "step_over_floor": measured_s / floor.seconds if floor else None,
    }


def _recorded_peak(device: torch.device, out: Path) -> str:
    """Stop recording CUDA's allocations; write the snapshot for memory_viz and what was alive
    at the window's peak by the line that allocated it (DIR/memory_peak.json); return the
    summary's lines of it."""
    torch.cuda.synchronize(device)
    try:
        snapshot = torch.cuda.memory._snapshot()
        (out / "memory_snapshot.pickle").write_bytes(pickle.dumps(snapshot))  # _dump_snapshot's
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)
    peak = peak_allocations(snapshot, device.index or 0)
    write_text_atomic(out / "memory_peak.json", json.dumps(peak.as_dict(), indent=1))
    return "\n" + format_peak(peak) + "\n"


def _unprofiled_step_s(one_step, first: int, steps: int, device: torch.device) -> float:
    """The median time of `steps` steps run without the profiler (which slows each op)."""
    times = []
    for step in range(first, first + steps):
        sync(device)
        t0 = time.perf_counter()
        one_step(step)
        sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def floor_line(floor_s: float, step_s: float) -> str:
    """The contract line scripts read from summary.txt."""
    return (
        f"matmul floor: {floor_s * 1e3:.1f} ms a step; measured {step_s * 1e3:.1f} ms = "
        f"{step_s / floor_s:.2f}x the floor"
    )


def _op_seconds(prof, steps: int, cuda: bool) -> dict[str, float]:
    """Self time per op and per profiled step: the framework's ops (`ns::name`) and compiled
    kernels, not Python frames (whose self time is mostly waiting on those ops)."""
    key = "self_device_time_total" if cuda else "self_cpu_time_total"
    found: dict[str, float] = {}
    for e in prof.key_averages():
        name = COMPILED_KERNEL.get(e.key, e.key)
        if e.key.startswith("triton_"):
            name = "compiled kernels (inductor, Triton)"
        if "::" in e.key or name != e.key:
            found[name] = found.get(name, 0.0) + getattr(e, key) / 1e6 / steps
    return found


def _gap_parts(events: dict[str, float], floor: Floor, scale: float) -> dict[str, float]:
    """Seconds a step of each part of the gap: the products and the attention kernels beyond
    their floor, every other op as it ran (profiled self time times `scale`)."""
    by_source = floor.by_source()
    matmul_s = sum(v for k, v in events.items() if is_gemm_name(k))
    attention_s = sum(v for k, v in events.items() if is_attention_name(k))
    attention_floor = sum(v for k, v in by_source.items() if k != "matmul")
    costs = {
        "matrix products beyond their floor": matmul_s * scale - by_source.get("matmul", 0),
        # self times of every attention op (SDPA's outer op and the kernel it calls) less the
        # floor of their products: the traced names are the CPU kernel's, a GPU runs others
        "attention kernels beyond their products": attention_s * scale - attention_floor,
    }
    for name, seconds in events.items():
        if not is_gemm_name(name) and not is_attention_name(name):
            costs[name.removeprefix("aten::")] = seconds * scale
    return costs


def floor_text(prof, trace: dict, floor: Floor, step_s: float, cuda: bool, top: int = 8) -> str:
    """The floor, the step against it, and where the gap goes: the profiled ops' self time per
    step, scaled to the unprofiled step, as a share of (step - floor). Matrix products count
    only their time beyond the floor (slower than alone), attention kernels likewise (their
    softmax and masking are non-matmul work inside them)."""
    spans = _step_spans(trace)
    profiled_s = statistics.median((b - a) / 1e6 for a, b in spans)
    gap = step_s - floor.seconds
    costs = _gap_parts(_op_seconds(prof, len(spans), cuda), floor, step_s / profiled_s)
    lines = [
        "",
        floor_line(floor.seconds, step_s),
        f"  {len(floor.calls)} distinct products, {floor.flops / 1e9:,.1f} GFLOP a step, each "
        f"timed alone on this device ({floor.flops / floor.seconds / 1e12:.2f} TFLOP/s); "
        f"attention counts as its batched products: "
        + ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in floor.by_source().items()),
        "  its largest products (time a step, calls, the rate each reaches alone):",
        *floor.largest(),
    ]
    if gap <= 0:  # timed alone under load, or a step truly at its floor: no parts to share out
        lines.append("  no gap measured: the step ran within its floor")
        return "\n".join(lines) + "\n"
    lines.append(
        f"  the gap ({gap * 1e3:.1f} ms a step), its largest parts (profiled self time scaled "
        "to the unprofiled step):"
    )
    for name, seconds in sorted(costs.items(), key=lambda kv: -kv[1])[:top]:
        lines.append(f"    {name:<48} {seconds * 1e3:9.1f} ms  {seconds / gap:6.1%} of the gap")
    return "\n".join(lines) + "\n"


def _step_spans(trace: dict) -> list[tuple[float, float]]:
    """(start, end) in us of each ProfilerStep#N span, in order."""
    spans = [
        (e["ts"], e["ts"] + e.get("dur", 0))
        for e in trace.get("traceEvents", [])
        if e.get("ph") == "X" and str(e.get("name", "")).startswith("ProfilerStep#")
    ]
    return sorted(spans)


def _syncs_in_step(trace: dict) -> dict[str, int]:
    """Sync ops issued inside forward/backward/optimizer (the data phase reads host tensors:
    counting the targets of a CPU batch is no device sync)."""
    events = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X"]
    spans = [
        (e["ts"], e["ts"] + e.get("dur", 0))
        for e in events
        if e.get("name") in PHASES[1:] and e.get("cat") == "user_annotation"
    ]
    found: dict[str, int] = {}
    for e in events:
        if e.get("name") not in SYNC_OPS or not any(a <= e["ts"] <= b for a, b in spans):
            continue
        # name the caller: the tightest enclosing event on the same thread that is no sync op
        callers = [
            c
            for c in events
            if c.get("tid") == e.get("tid")
            and c["name"] not in SYNC_OPS
            and c["ts"] <= e["ts"] <= c["ts"] + c.get("dur", 0)
        ]
        caller = min(callers, key=lambda c: c.get("dur", 0))["name"] if callers else "?"
        key = f"{e['name']} in {caller}"
        found[key] = found.get(key, 0) + 1
    return found


def _phase_times(trace: dict) -> dict[str, float]:
    """Total milliseconds inside each annotated phase (host-side spans)."""
    total = dict.fromkeys(PHASES, 0.0)
    for e in trace.get("traceEvents", []):
        if e.get("ph") == "X" and e.get("name") in total and e.get("cat") == "user_annotation":
            total[e["name"]] += e.get("dur", 0) / 1e3
    return total


def summary_text(
    prof, trace: dict, built: Built, steps: int, cuda: bool, floor_part: str = ""
) -> str:
    cfg = built.cfg
    spans = _step_spans(trace)
    durations = [(b - a) / 1e3 for a, b in spans]
    gaps = [(spans[i + 1][0] - spans[i][1]) / 1e3 for i in range(len(spans) - 1)]
    phases = _phase_times(trace)
    events = prof.key_averages()
    syncs = {
        k: v
        for k, v in _syncs_in_step(trace).items()
        if not k.startswith("aten::_local_scalar_dense")  # the inside of each .item()
    }
    time_key = "self_cuda_time_total" if cuda else "self_cpu_time_total"
    mem_key = "self_cuda_memory_usage" if cuda else "self_cpu_memory_usage"
    tokens = cfg.train.batch_size * cfg.train_seq_len
    step_ms = statistics.median(durations) if durations else float("nan")
    lines = [
        f"onegpu profile: {built.n_params:,} parameters on {built.device}, {built.policy.name}, "
        f"batch {cfg.train.batch_size}x{cfg.train_seq_len} in {cfg.grad_accum_steps} micro-batch(es), "
        f"{steps} profiled steps",
        "where bytes live: " + ", ".join(f"{k} {v}" for k, v in built.homes().items()),
        "",
        f"step time (median of profiled steps): {step_ms:.1f} ms  ->  {tokens / step_ms * 1e3:,.0f} tokens/s "
        "(under the profiler: slower than a real run)",
        "",
        "phases (host time, all profiled steps):",
    ]
    whole = sum(durations) or float("nan")
    for name in PHASES:
        lines.append(f"  {name:<10} {phases[name]:10.1f} ms  {phases[name] / whole:6.1%}")
    lines += [
        "",
        "idle gaps between steps: "
        + (", ".join(f"{g:.2f} ms" for g in gaps) if gaps else "none measured (1 step)"),
        "host-device synchronisations (.item() and CUDA syncs) inside forward/backward/optimizer: "
        + (", ".join(f"{k} x{v}" for k, v in sorted(syncs.items())) if syncs else "none found"),
        "  (on CPU, torch's fused AdamW kernel reads its step counter with .item(): no device sync)"
        if any("_fused_adam" in k for k in syncs)
        else "",
        floor_part,
        f"top operations by self time ({time_key}):",
        events.table(sort_by=time_key, row_limit=15, max_name_column_width=48),
        f"top operations by memory allocated ({mem_key}):",
        events.table(sort_by=mem_key, row_limit=10, max_name_column_width=48),
    ]
    return "\n".join(lines) + "\n"


def _plot_memory(
    times_us: list[int], groups: dict[str, list[int]], steps: list[tuple[float, float]], out: Path
) -> None:
    """Stacked memory timeline (GiB vs ms) as memory.png and a memory.html that embeds it."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t0 = steps[0][0] if steps else (times_us[0] if times_us else 0)
    t_ms = [max(0.0, (t - t0) / 1e3) for t in times_us]  # tensors alive before: at 0
    fig, ax = plt.subplots(figsize=(12, 4.5), dpi=100)
    ax.stackplot(t_ms, *[[b / 2**20 for b in groups[g]] for g in GROUPS], labels=GROUPS)
    for a, _ in steps:
        ax.axvline((a - t0) / 1e3, color="k", lw=0.6, ls=":")
    ax.set_xlabel("time (ms); dotted lines: step starts")
    ax.set_ylabel("MiB allocated")
    ax.set_title("memory timeline of the profiled steps, by kind")
    ax.legend(loc="upper left", fontsize=8)
    fig.tight_layout()
    with atomic_path(out / "memory.png") as tmp:
        fig.savefig(tmp)
    plt.close(fig)
    png = base64.b64encode((out / "memory.png").read_bytes()).decode()
    (out / "memory.html").write_text(
        "<!doctype html><html><head><meta charset='utf-8'><title>onegpu memory timeline</title>"
        "</head><body><h3>Memory timeline (tensor allocations, torch.profiler)</h3>"
        f"<img src='data:image/png;base64,{png}'/></body></html>\n"
    )
