"""Everything only a GPU can show, in one command, for the first GPU a session is lent.

Sections, each written to the result file as soon as it is done (a run cut short keeps what it
measured):

- tests: `pytest -m gpu`, the CUDA-only paths (deselected on CPUs, never counted there).
- memory: `onegpu plan --json`'s predicted step peak against `torch.cuda.max_memory_allocated`
  of a real run, for configurations covering precision, every checkpointing policy kind, each
  offload tier (optimizer on the host, in backward too; the optimizer on disk; activations;
  weights through FSDP2's CPU offload; states on the host stepped on the GPU), budget
  checkpointing and a lean optimizer. Target: within 10%.
- explain: for each memory row whose plan is more than 5% off (this run's, or those of
  `--explain-from FILE.json`): `onegpu profile` of it, and what was alive at its peak, summed by
  the line of onegpu's code that allocated it (memory/snapshot.py).
- overlap: the optimizer on the host, after backward and in backward, against the device
  optimizer: the steady step of each, and from a profiler trace of the in-backward step how much
  of the host's stepping ran while the GPU was still busy with backward (the rest is exposed).
- speed: tokens/s, MFU and peak memory of models A (seed-ref), B (6 x d384) and a 1B GPT,
  `onegpu train` with its defaults against a nanoGPT-style loop (GPT-2 from transformers, SDPA,
  bf16 autocast, fused AdamW, clipping, `torch.compile` of the whole model), one after the other
  in fresh processes, random tokens of the model's vocabulary for both.

Usage: python benchmarks/gpu_suite.py [--sections tests,memory,explain,overlap,speed] [--out DIR]
       [--speed-models A,B,1B] [--budget-s SECONDS] [--explain-from FILE.json]
       [--quick]   (CPU dry run of the machinery: tiny shapes, no timings worth reading)
Writes <out>/gpu-<device>-<date>[-N].md and .json (default out: benchmarks/results).
`--budget-s`: end inside one command of a device lease (benchmarks/gpu_lease.py); how to run
the suite on a lent machine is docs/gpu-suite.md.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import platform
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gpu_lease import Budget
from gpu_suite_report import markdown

from onegpu.tools.bench import kernels_chosen, run_row
from onegpu.tools.processes import end_group, run_bounded, start

SECTIONS = ("tests", "memory", "explain", "overlap", "speed")
BASE = {"model.dropout": "0", "data.bin_dtype": "uint16", "train.compile": "none",
        # the peak is the caching allocator's either way: no profiled step, no startup plan
        "train.measure_memory": "false", "train.skip_memory_check": "true"}  # fmt: skip
GPT2 = {"__preset": "gpt2", "train.batch_size": "8", "train.micro_batch_size": "8"}
WORK = "{work}"
"""Stands for the suite's work folder in a row's overrides (the disk tier's files go there)."""
MEMORY_GRID: list[tuple[str, dict[str, str]]] = [
    ("bf16", {}),
    ("fp32, block checkpointing", {"train.precision": "fp32", "memory.checkpointing": "block"}),
    ("bf16, selective", {"memory.checkpointing": "selective"}),
    ("bf16, attn+mlp, accumulation x4", {"memory.checkpointing": "attn+mlp", "train.micro_batch_size": "2"}),
    ("bf16-pure, 8-bit AdamW", {"train.precision": "bf16-pure", "optim.name": "adamw8bit"}),
    ("budget checkpointing, 4.5 GB", {"memory.checkpointing": "budget:4500000000"}),
    ("optimizer on the host", {"memory.offload_optimizer": "true"}),
    ("optimizer on the host, in backward, accumulation x2",
     {"memory.offload_optimizer": "true", "optim.in_backward": "true", "optim.grad_clip": "0",
      "train.micro_batch_size": "4"}),
    ("activations on the host", {"memory.offload_activations": "true"}),
    ("weights on the host (FSDP2 CPU offload)", {"memory.offload_params": "true"}),
    ("optimizer on disk (weight copies and states in mapped files)",
     {"memory.offload_optimizer": "true", "memory.offload_dir": f"{WORK}/offload"}),
    ("states on the host, stepped on the GPU, in backward, 8-bit",
     {"memory.offload_states": "true", "optim.in_backward": "true", "optim.grad_clip": "0",
      "train.precision": "bf16-pure", "optim.name": "adamw8bit"}),
]  # fmt: skip
OVERLAP_ROWS = {
    "optimizer on the device": {"optim.grad_clip": "0"},
    "optimizer on the host, after backward": {"memory.offload_optimizer": "true", "optim.grad_clip": "0"},
    "optimizer on the host, in backward": {"memory.offload_optimizer": "true", "optim.in_backward": "true",
                                           "optim.grad_clip": "0"},
    "states on the host, stepped on the GPU, in backward": {"memory.offload_states": "true",
                                                            "optim.in_backward": "true",
                                                            "optim.grad_clip": "0"},
}  # fmt: skip
SPEED_MODELS = {
    "A": {"n_layer": 4, "n_head": 4, "d_model": 256, "seq_len": 512, "vocab_size": 50257, "batch": 8},
    "B": {"n_layer": 6, "n_head": 6, "d_model": 384, "seq_len": 256, "vocab_size": 8192, "batch": 16},
    "1B": {"n_layer": 20, "n_head": 16, "d_model": 2048, "seq_len": 1024, "vocab_size": 50257, "batch": 8},
}  # fmt: skip
SPEED_GUESS_S = {"1B": 180.0}
"""The least a speed row of this model is taken to need, whatever A and B took (the H200's
1B row took 146 s: benchmarks/results/gpu-nvidia-h200-2026-11-28-2.md)."""
HORIZON = 5000
"""The speed rows' run length: onegpu's `auto` decides (compiles) as for a real run of this
many steps, stopped gracefully once its timed steps are done (the loop is timed after its own
compile, so a 30-step run that rightly stays eager is no comparison)."""
QUICK = {"__preset": "tiny", "train.batch_size": "4", "train.micro_batch_size": "4"}
QUICK_SPEED = {
    "n_layer": 2,
    "n_head": 2,
    "d_model": 64,
    "seq_len": 64,
    "vocab_size": 512,
    "batch": 4,
}


def _tokens_file(folder: Path, vocab: int) -> Path:
    """Random tokens of the vocabulary as a nanoGPT .bin: no tokenizer to train on the GPU box."""
    path = folder / f"tokens-{vocab}.bin"
    if not path.exists():
        rng = np.random.default_rng(0)
        rng.integers(0, vocab, size=4_000_000, dtype=np.uint16).tofile(path)
    return path


def _overrides(base: dict[str, str], extra: dict[str, str], work: Path) -> tuple[str, dict]:
    over = {k: v.replace(WORK, str(work)) for k, v in {**BASE, **base, **extra}.items()}
    preset = over.pop("__preset", "tiny")
    vocab = int(over.get("model.vocab_size", 50257 if preset.startswith("gpt2") else 256))
    over["data.source"] = str(_tokens_file(work, vocab))
    return preset, over


def _aside() -> tuple[dict[str, str], Callable[[], None] | None]:
    """What keeps a plan off a timed run's host CPU: the upper half of this process's cores
    (as many torch threads), at the lowest priority. A launch-bound GPU step is as fast as
    the host thread that launches it, so a plan beside it on the same cores would slow it."""
    cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    if len(cores) < 4:  # too few to share: the plan only yields
        return {}, lambda: os.nice(19)
    upper = set(cores[len(cores) // 2 :])

    def confine() -> None:
        os.sched_setaffinity(0, upper)
        os.nice(19)

    return {"OMP_NUM_THREADS": str(len(upper))}, confine


@contextlib.contextmanager
def _planning(
    args: argparse.Namespace, preset: str, over: dict[str, str], *, aside: bool = False
) -> Iterator[Any]:
    """`onegpu plan --json` in the background (it plans on the CPU while the GPU runs); the
    plan, read with `.result()`, is ended with the row whatever happens to it. `aside`: beside
    a timed run, on cores of its own (`_aside`)."""
    cmd = [sys.executable, "-m", "onegpu", "plan", "--preset", preset, "--json"]
    cmd += ["--gpu", args.gpu] if args.gpu else []
    for k, v in over.items():
        cmd += [f"--{k}", v]
    env, confine = _aside() if aside else ({}, None)
    proc = start(
        cmd,
        args.budget.timeout(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, **env},
        preexec_fn=confine,
    )

    def result() -> dict[str, Any]:
        out, err = proc.communicate(timeout=args.budget.timeout())
        if proc.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)}: {err.strip()[-800:]}")
        return json.loads(out)

    try:
        yield result
    finally:
        if proc.poll() is None:
            end_group(proc)


def _worker(job: list[str], args: argparse.Namespace, **kwargs: Any) -> subprocess.CompletedProcess:
    """A child process, ended with what it started at the end of the budget (TimeoutExpired)."""
    return run_bounded(job, args.budget.timeout(), **kwargs)


def _budgeted(
    args: argparse.Namespace,
    section: str,
    row: dict[str, Any],
    job: Callable[[dict[str, Any]], None],
    guess_s: float | None = None,
) -> dict[str, Any]:
    """`job` fills `row` if it fits what is left of the budget, else the row says it was left
    out; a failure (the budget's kill included) is the row's finding, not the suite's end."""
    if reason := args.budget.skip_reason(section, guess_s):
        return row | {"skipped": reason}
    t0 = time.perf_counter()
    try:
        job(row)
    except Exception as e:
        row["failed"] = str(e)[-1500:]
    args.budget.took(section, time.perf_counter() - t0)
    return row


def _base(args: argparse.Namespace) -> dict[str, str]:
    return QUICK if args.quick else GPT2


def section_tests(args: argparse.Namespace) -> dict[str, Any]:
    command = "python -m pytest -m gpu tests"
    if reason := args.budget.skip_reason("tests"):
        return {"command": command, "rc": None, "summary": reason, "tail": [], "skipped": reason}
    cmd = [sys.executable, "-m", "pytest", "-m", "gpu", "-q", "-p", "no:cacheprovider", "tests"]
    t0 = time.perf_counter()
    try:
        proc = _worker(cmd, args, cwd=Path(__file__).parents[1])
    except subprocess.TimeoutExpired as e:  # what it printed says which test it was in
        printed = e.stdout.decode(errors="replace") if isinstance(e.stdout, bytes) else e.stdout
        return {"command": command, "rc": None, "summary": "killed at the end of --budget-s",
                "tail": (printed or "").strip().splitlines()[-30:],
                "wall_s": time.perf_counter() - t0}  # fmt: skip
    args.budget.took("tests", time.perf_counter() - t0)
    tail = proc.stdout.strip().splitlines()[-30:]
    return {"command": command, "rc": proc.returncode,
            "summary": tail[-1] if tail else proc.stderr[-300:], "tail": tail,
            "wall_s": time.perf_counter() - t0}  # fmt: skip


def _memory_row(args: argparse.Namespace, extra: dict[str, str], row: dict[str, Any]) -> None:
    preset, over = _overrides(_base(args), extra, args.work)
    row["preset"] = preset
    if args.quick:  # a CPU's step peak comes from the profiled step
        over["train.measure_memory"] = "true"
    with _planning(args, preset, over) as plan_of:
        run = run_row(preset, None, over, 4, args.work, timeout_s=args.budget.timeout())
        row |= {"measured_peak": run["peak_mem_bytes"], "kind": run["peak_mem_kind"],
                "step_time_s": run["step_time_s"]}  # fmt: skip
        plan = plan_of()
    row |= {
        "planned_peak": plan["memory"]["peak"],
        "error": plan["memory"]["peak"] / run["peak_mem_bytes"] - 1,
        "planned_host": plan.get("host_memory_bytes"),
        "predicted_step_time_s": plan.get("predicted_step_time_s"),
        "planned_memory": plan["memory"],
        "measured_memory": run["memory"],
        "kernels": run["kernels"],  # what the run chose: a later plan can follow the same
    } | _kernels_apart(plan, run)


def _kernels_apart(plan: dict[str, Any], run: dict[str, Any]) -> dict[str, Any]:
    """The kernels the plan followed where the run chose others ({} where they agree): the
    plan runs beside the run, before the run has cached its timed choices."""
    planned = kernels_chosen(plan["config"])
    return {} if planned == run["kernels"] else {"kernels_apart": {"plan": planned,
                                                                  "run": run["kernels"]}}  # fmt: skip


def section_memory(args: argparse.Namespace) -> list[dict[str, Any]]:
    rows = []
    for name, extra in MEMORY_GRID:
        row = {"name": name, "overrides": extra}
        row = _budgeted(args, "memory", row, lambda r, e=extra: _memory_row(args, e, r))
        rows.append(row)
        args.save("memory", rows)
        print(
            f"memory: {name}: {row.get('error', row.get('failed', row.get('skipped')))}", flush=True
        )
    return rows


EXPLAIN_OVER = 0.05
"""A memory row whose plan is further off its measured peak than this is explained: what was
alive at its peak, by the line that allocated it (onegpu profile's memory_peak.json)."""


def section_explain(args: argparse.Namespace) -> list[dict[str, Any]]:
    """For each memory row of this run (or of --explain-from's file) off by more than
    EXPLAIN_OVER: `onegpu profile` of the same configuration, and its peak by allocation site."""
    rows = args.results.get("memory")
    if rows is None and args.explain_from:
        rows = json.loads(Path(args.explain_from).read_text()).get("memory")
    if not rows:  # not "nothing to explain": nothing was read
        raise RuntimeError(
            "no memory rows to explain: run the memory section before it, or give --explain-from"
        )
    explained = []
    for row in rows:
        if abs(row.get("error", 0.0)) <= EXPLAIN_OVER:
            continue
        item = {"name": row["name"], "overrides": row["overrides"], "error": row["error"],
                "planned_peak": row["planned_peak"], "measured_peak": row["measured_peak"]}  # fmt: skip
        item = _budgeted(args, "explain", item, lambda r: _explain_row(args, r))
        explained.append(item)
        args.save("explain", explained)
    return explained


def _explain_row(args: argparse.Namespace, row: dict[str, Any]) -> None:
    preset, over = _overrides(_base(args), row["overrides"], args.work)
    folder = Path(tempfile.mkdtemp(prefix="explain-", dir=args.work))
    cmd = [sys.executable, "-m", "onegpu", "profile", "--preset", preset, "--steps", "1",
           "--warmup", "2", "--out", str(folder)]  # fmt: skip
    for k, v in over.items():
        cmd += [f"--{k}", v]
    proc = _worker(cmd, args)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)}: {proc.stderr.strip()[-1200:]}")
    peak = folder / "memory_peak.json"
    if not peak.exists():  # a CPU's profile records no allocator trace
        raise RuntimeError(f"no {peak.name}: onegpu profile writes it on CUDA only")
    row |= json.loads(peak.read_text())


def _trace_overlap(
    trace: dict[str, Any], host_ns: list[tuple[int, int]], anchor_ns: int
) -> dict[str, Any]:
    """One in-backward step, in seconds: the host steps' total time and the part of it after
    the compute stream's last kernel (exposed: backward was done and waited for the host); the
    compute stream's span; the link's copies on the other streams (the gradients' and weights'
    side stream), each way, gradients out (DtoH) and weights back (HtoD), and the part of each
    after that kernel.
    The compute stream is the one the step's own thread launched most kernels on (forward's:
    backward launches from autograd's device thread, on the same stream), matched by launch
    and kernel `correlation`; where the trace links no launch to that thread, the stream with
    the most kernels (`compute_stream_by` says which). The side stream's kernels (a weight sent
    back and cast to bf16, or states stepped on the GPU) follow each host step and would hide
    it. The host steps run on a worker thread the profiler does not follow, so they are timed
    by `perf_counter_ns` and placed on the trace's clock through the anchor, marked at
    `anchor_ns`."""
    events = trace.get("traceEvents", [])
    total = sum(end - start for start, end in host_ns) / 1e9
    kernels = [e for e in events if e.get("cat") == "kernel" and "dur" in e]
    anchors = [e for e in events
               if e.get("name") == "onegpu.anchor" and e.get("cat", "user_annotation") == "user_annotation"]  # fmt: skip
    found: dict[str, Any] = {"host_step_s": total, "host_steps": len(host_ns)}
    if not host_ns or not kernels or not anchors:
        nan = float("nan")
        return found | {"exposed_s": nan, "compute_s": nan, "copies": 0, "link_out_s": nan,
                        "link_back_s": nan, "link_out_exposed_s": nan,
                        "link_back_exposed_s": nan}  # fmt: skip
    compute, by = _compute_stream(events, kernels, anchors[0])
    on_compute = [e for e in kernels if _stream(e) == compute]
    first = min(e["ts"] for e in on_compute)
    last = max(e["ts"] + e["dur"] for e in on_compute)
    offset_us = anchor_ns / 1e3 - anchors[0]["ts"]  # trace ts = perf_counter us - offset
    last_us = last + offset_us  # on the host's clock
    exposed_us = sum(_after(start / 1e3, end / 1e3, last_us) for start, end in host_ns)
    copies = {way: [(e["ts"], e["ts"] + e["dur"]) for e in events
                    if e.get("cat") == "gpu_memcpy" and "dur" in e and way in e.get("name", "")
                    and _stream(e) != compute]  # the loss read back and the like: not the link
              for way in ("DtoH", "HtoD")}  # fmt: skip
    return found | {
        "exposed_s": exposed_us / 1e6,
        "compute_s": (last - first) / 1e6,
        "compute_stream_by": by,
        "copies": sum(map(len, copies.values())),
        "link_out_s": _span_sum(copies["DtoH"]),
        "link_back_s": _span_sum(copies["HtoD"]),
        "link_out_exposed_s": sum(_after(a, b, last) for a, b in copies["DtoH"]) / 1e6,
        "link_back_exposed_s": sum(_after(a, b, last) for a, b in copies["HtoD"]) / 1e6,
    }


def _stream(event: dict[str, Any]) -> Any:
    return event.get("args", {}).get("stream")


def _compute_stream(events: list[dict], kernels: list[dict], anchor: dict) -> tuple[Any, str]:
    """(the stream the anchor's thread launched most kernels on, 'launches'), launch and
    kernel sharing a `correlation` id (runtime or driver launches: inductor's kernels go
    through the driver); else (the stream with the most kernels, 'most kernels')."""
    launched = {e["args"]["correlation"] for e in events
                if e.get("cat") in ("cuda_runtime", "cuda_driver") and e.get("tid") == anchor.get("tid")
                and "correlation" in e.get("args", {})}  # fmt: skip
    own = [e for e in kernels if e.get("args", {}).get("correlation") in launched]
    stream = Counter(map(_stream, own or kernels)).most_common(1)[0][0]
    return stream, "launches" if own else "most kernels"


def _span_sum(spans: list[tuple[float, float]]) -> float:
    """Total length of trace spans (us), in seconds."""
    return sum(end - start for start, end in spans) / 1e6


def _after(start: float, end: float, mark: float) -> float:
    """How much of [start, end] lies after `mark`."""
    return max(0.0, end - max(start, mark))


@contextlib.contextmanager
def _timed(owner: Any, name: str, spans: list[tuple[int, int]]) -> Iterator[None]:
    """`owner.name` (a method or a module's function) timed inside: each call's (start, end)
    in perf_counter_ns appended to `spans`, whatever its thread."""
    real = getattr(owner, name)

    def timed(*args: Any, **kwargs: Any) -> Any:
        begun = time.perf_counter_ns()
        try:
            return real(*args, **kwargs)
        finally:
            spans.append((begun, time.perf_counter_ns()))

    setattr(owner, name, timed)
    try:
        yield
    finally:
        setattr(owner, name, real)


@contextlib.contextmanager
def _timing_host_work() -> Iterator[dict[str, list[tuple[int, int]]]]:
    """The host's parts of an in-backward step, each call as (start, end) in perf_counter_ns:
    `step` each host step (the worker thread), `land` each gradient's copy waited for and
    added in (the worker thread, or the engine's for a ring that must make room), `room` each
    wait of backward for a stretch of the staging ring (landing the oldest copies)."""
    from onegpu.offload import host_optimizer
    from onegpu.offload.staging_ring import StagingRing

    spans: dict[str, list[tuple[int, int]]] = {"step": [], "land": [], "room": []}
    with contextlib.ExitStack() as stack:
        stack.enter_context(_timed(host_optimizer.HostOffloadOptimizer, "_stepped_copy", spans["step"]))  # fmt: skip
        stack.enter_context(_timed(host_optimizer, "_add_arrived", spans["land"]))
        stack.enter_context(_timed(StagingRing, "_room_for", spans["room"]))
        yield spans


def _host_work(spans: dict[str, list[tuple[int, int]]]) -> dict[str, Any]:
    """Totals of _timing_host_work's parts, in seconds, and how many of each; `room` counts
    only the waits that landed copies (over 0.1 ms), not every stretch taken."""
    waits = [(a, b) for a, b in spans["room"] if b - a > 100_000]
    return {
        "land_s": sum(b - a for a, b in spans["land"]) / 1e9,
        "lands": len(spans["land"]),
        "room_wait_s": sum(b - a for a, b in waits) / 1e9,
        "room_waits": len(waits),
    }


def _profile_in_backward(preset: str, over: dict[str, str], out: Path) -> dict[str, float]:
    """Worker: three steps, the fourth under the profiler; the trace's overlap figures."""
    from onegpu.backends.torch.build import build
    from onegpu.config import load_config

    cfg = load_config(preset, overrides=over)
    built = build(cfg, with_data=False)
    g = torch.Generator().manual_seed(0)
    shape = (cfg.train.batch_size, cfg.train_seq_len + 1)
    x = torch.randint(0, cfg.model.vocab_size, shape, generator=g).to(built.device)
    for i in range(3):
        built.step(x[:, :-1], x[:, 1:], x[:, 1:].numel(), i)
    activities = [torch.profiler.ProfilerActivity.CPU]
    if built.device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
        torch.cuda.synchronize()
    with _timing_host_work() as spans, torch.profiler.profile(activities=activities) as prof:
        with torch.profiler.record_function("onegpu.anchor"):
            anchor_ns = time.perf_counter_ns()
        built.step(x[:, :-1], x[:, 1:], x[:, 1:].numel(), 3)
        if built.device.type == "cuda":
            torch.cuda.synchronize()
        step_s = (time.perf_counter_ns() - anchor_ns) / 1e9  # profiled: slower than the row's
    prof.export_chrome_trace(str(out))
    overlap = _trace_overlap(json.loads(out.read_text()), spans["step"], anchor_ns)
    return overlap | _host_work(spans) | {"step_s": step_s}


def _overlap_row(args: argparse.Namespace, extra: dict[str, str], row: dict[str, Any]) -> None:
    preset, over = _overrides(_base(args), extra, args.work)
    run = run_row(preset, None, over, 12, args.work, timeout_s=args.budget.timeout())
    row |= {"step_time_s": run["step_time_s"], "peak": run["peak_mem_bytes"]}


def _overlap_trace(args: argparse.Namespace, row: dict[str, Any]) -> None:
    extra = OVERLAP_ROWS["optimizer on the host, in backward"]
    preset, over = _overrides(_base(args), extra, args.work)
    trace = args.work / "host-step-trace.json"
    cmd = [sys.executable, __file__, "--profile-worker", json.dumps([preset, over, str(trace)])]
    proc = _worker(cmd, args)
    if proc.returncode != 0:
        raise RuntimeError(proc.stderr[-1500:])
    row |= json.loads(proc.stdout.strip().splitlines()[-1])


def section_overlap(args: argparse.Namespace) -> dict[str, Any]:
    """Each row, then the trace; a row that fails or does not fit is said so, the rest go on."""
    result: dict[str, Any] = {"rows": {}}
    for name, extra in OVERLAP_ROWS.items():
        job = lambda r, e=extra: _overlap_row(args, e, r)  # noqa: E731
        result["rows"][name] = _budgeted(args, "overlap", {}, job)
        args.save("overlap", result)
    result["trace"] = _budgeted(args, "overlap", {}, lambda r: _overlap_trace(args, r))
    args.save("overlap", result)
    return result


def _loop_worker(shape: dict[str, int], steps: int, tokens: str) -> dict[str, Any]:
    """The nanoGPT-style loop: GPT-2 from transformers, autocast, fused AdamW, clip, compile."""
    from transformers import GPT2Config, GPT2LMHeadModel

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    cfg = GPT2Config(n_layer=shape["n_layer"], n_head=shape["n_head"], n_embd=shape["d_model"],
                     n_positions=shape["seq_len"], vocab_size=shape["vocab_size"], resid_pdrop=0.0,
                     embd_pdrop=0.0, attn_pdrop=0.0, attn_implementation="sdpa")  # fmt: skip
    torch.manual_seed(1337)
    model = GPT2LMHeadModel(cfg).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, betas=(0.9, 0.95), weight_decay=0.1,
                            fused=device.type == "cuda")  # fmt: skip
    forward = torch.compile(model)
    data = torch.from_numpy(np.fromfile(tokens, dtype=np.uint16).astype(np.int64))
    B, T = shape["batch"], shape["seq_len"]
    times = []
    for step in range(steps):
        t0 = time.perf_counter()
        x = data[step * B * T : (step + 1) * B * T].view(B, T).to(device, non_blocking=True)
        with torch.autocast(device.type, dtype=torch.bfloat16):
            loss = forward(input_ids=x, labels=x).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        loss.item()
        times.append(time.perf_counter() - t0)
    peak = torch.cuda.max_memory_allocated() if device.type == "cuda" else None
    return {"times": times, "peak": peak}


def _model_overrides(shape: dict[str, int]) -> dict[str, str]:
    over = {f"model.{k}": str(v) for k, v in shape.items() if k != "batch"}
    return over | {"train.batch_size": str(shape["batch"]), "train.micro_batch_size": str(shape["batch"])}  # fmt: skip


def _speed_row(args: argparse.Namespace, row: dict[str, Any]) -> None:
    """onegpu with its defaults, then the loop, on the same shape; fills `row` as it goes (a
    loop or plan that fails keeps onegpu's measured half)."""
    name, shape = row["model"], row["shape"]
    steps = 12 if args.quick else (20 if name == "1B" else 30)
    preset, over = _overrides({}, _model_overrides(shape), args.work)
    if not args.quick:  # onegpu's defaults decide, as for a long run
        over.pop("train.compile")
    with _planning(args, preset, over, aside=True) as plan_of:
        one = run_row(preset, None, over, steps, args.work, timeout_s=args.budget.timeout(),
                      horizon=HORIZON)  # fmt: skip
        row["onegpu"] = {"tokens_per_s": one["tokens_per_s"], "mfu": one["mfu"],
                         "peak": one["peak_mem_bytes"], "compile_time_s": one["compile_time_s"],
                         "compile": one["compile"], "compile_auto": one["compile_auto"],
                         "planned_peak": None, "predicted_tokens_per_s": None,
                         "measured_memory": one["memory"]}  # fmt: skip
        try:  # a plan that fails is a finding beside the row, not the loop's end
            plan = plan_of()
            row["onegpu"] |= {"planned_peak": plan["memory"]["peak"],
                              "predicted_tokens_per_s": plan["predicted_tokens_per_s"],
                              "bound": plan.get("bound"),
                              "planned_memory": plan["memory"], **_kernels_apart(plan, one)}  # fmt: skip
        except Exception as e:
            row["onegpu"]["plan_failed"] = str(e)[-800:]
    job = json.dumps([shape, steps, over["data.source"]])
    proc = _worker([sys.executable, __file__, "--loop-worker", job], args)
    if proc.returncode != 0:
        raise RuntimeError(f"loop: {proc.stderr[-1500:]}")
    loop = json.loads(proc.stdout.strip().splitlines()[-1])
    step = statistics.median(loop["times"][5:])
    tokens = shape["batch"] * shape["seq_len"]
    speedup = tokens / step / one["tokens_per_s"]  # the same FLOPs per token
    row["loop"] = {"tokens_per_s": tokens / step, "peak": loop["peak"],
                   "mfu": one["mfu"] * speedup if one["mfu"] else None,
                   "first_step_s": loop["times"][0]}  # fmt: skip
    row["ratio"] = row["onegpu"]["tokens_per_s"] / row["loop"]["tokens_per_s"]


def section_speed(args: argparse.Namespace) -> list[dict[str, Any]]:
    rows = []
    models = {"quick": QUICK_SPEED} if args.quick else {m: SPEED_MODELS[m] for m in args.models}
    for name, shape in models.items():
        row = {"model": name, "shape": shape}
        guess = SPEED_GUESS_S.get(name)  # a larger model than the rows timed so far
        row = _budgeted(args, "speed", row, lambda r: _speed_row(args, r), guess)
        rows.append(row)
        args.save("speed", rows)
        print(
            f"speed: {name}: {row.get('ratio', row.get('failed', row.get('skipped')))}", flush=True
        )
    return rows


def _environment() -> dict[str, str]:
    cuda = torch.cuda.is_available()
    return {"device": torch.cuda.get_device_name() if cuda else "cpu",
            "torch": torch.__version__, "cuda": str(torch.version.cuda),
            "cpu": platform.processor() or platform.machine(),
            "date": str(datetime.date.today())}  # fmt: skip


def _result_path(out: Path, device: str) -> Path:
    slug = re.sub(r"[^a-z0-9]+", "-", device.lower()).strip("-")
    stem = out / f"gpu-{slug}-{datetime.date.today()}"
    path, n = stem.with_suffix(".md"), 2
    while path.exists():
        path, n = Path(f"{stem}-{n}.md"), n + 1
    return path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--sections", default=",".join(SECTIONS))
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    ap.add_argument("--gpu", default="", help="the planner's GPU (default: the one it detects)")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument(
        "--speed-models",
        default=",".join(SPEED_MODELS),
        help=f"the speed section's models, from {', '.join(SPEED_MODELS)}",
    )
    ap.add_argument(
        "--budget-s",
        type=float,
        default=None,
        help="end within this many seconds, leaving out rows that would not fit",
    )
    ap.add_argument(
        "--explain-from",
        help="a results .json whose memory rows the explain section reads when this run "
        "measures none",
    )
    ap.add_argument("--loop-worker", help=argparse.SUPPRESS)
    ap.add_argument("--profile-worker", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.loop_worker:
        print(json.dumps(_loop_worker(*json.loads(args.loop_worker))))
        return
    if args.profile_worker:
        preset, over, trace = json.loads(args.profile_worker)
        print(json.dumps(_profile_in_backward(preset, over, Path(trace))))
        return
    sections = args.sections.split(",")
    if bad := [x for x in sections if x not in SECTIONS]:
        ap.error(f"--sections: unknown {bad[0]!r}; choose from {', '.join(SECTIONS)}")
    args.models = args.speed_models.split(",")
    if bad := [m for m in args.models if m not in SPEED_MODELS]:
        ap.error(f"--speed-models: unknown {bad[0]!r}; choose from {', '.join(SPEED_MODELS)}")
    args.budget = Budget(args.budget_s)
    for sig in (signal.SIGTERM, signal.SIGHUP):  # unwind, so every row's group is ended
        signal.signal(sig, lambda signum, frame: sys.exit(128 + signum))
    if not args.gpu and torch.cuda.is_available():  # the table's row for this GPU
        from onegpu.perf.devices import gpu_spec_for

        spec = gpu_spec_for(torch.cuda.get_device_name())
        args.gpu = spec.name if spec else ""
    args.out.mkdir(parents=True, exist_ok=True)
    args.work = Path(tempfile.mkdtemp(prefix="gpu-suite-"))
    results: dict[str, Any] = {"environment": _environment(), "command": " ".join(sys.argv),
                               "planned_for": args.gpu or "this machine",
                               "budget_s": args.budget_s}  # fmt: skip
    path = _result_path(args.out, results["environment"]["device"])
    run = {"tests": section_tests, "memory": section_memory, "explain": section_explain,
           "overlap": section_overlap, "speed": section_speed}  # fmt: skip
    args.results = results

    def save(section: str, value: Any) -> None:
        """Write what is measured so far: a run cut short keeps every finished row."""
        results[section] = value
        path.write_text(markdown(results))
        path.with_suffix(".json").write_text(json.dumps(results, indent=1, default=str))

    args.save = save
    for name in sections:
        t0 = time.perf_counter()
        try:
            results[name] = run[name](args)
        except Exception as e:  # the sections after it still run
            results[f"{name}_failed"] = repr(e)[-1500:]
        results.setdefault("section_s", {})[name] = time.perf_counter() - t0
        if name in results:
            save(name, results[name])
        else:
            save(f"{name}_failed", results[f"{name}_failed"])
        print(f"{name}: {time.perf_counter() - t0:.0f} s -> {path}", flush=True)


if __name__ == "__main__":
    main()
