"""Everything only a GPU can show, in one command, for the first GPU a session is lent.

Sections, each written to the result file as soon as it is done (a run cut short keeps what it
measured):

- tests: `pytest -m gpu`, the CUDA-only paths (deselected on CPUs, never counted there).
- memory: `onegpu plan --json`'s predicted step peak against `torch.cuda.max_memory_allocated`
  of a real run, for configurations covering precision, every checkpointing policy kind, each
  offload tier (optimizer on the host, in backward too; activations; weights through FSDP2's
  CPU offload), budget checkpointing and a lean optimizer. Target: within 10%.
- overlap: the optimizer on the host, after backward and in backward, against the device
  optimizer: the steady step of each, and from a profiler trace of the in-backward step how much
  of the host's stepping ran while the GPU was still busy with backward (the rest is exposed).
- speed: tokens/s, MFU and peak memory of models A (seed-ref), B (6 x d384) and a 1B GPT,
  `onegpu train` with its defaults against a nanoGPT-style loop (GPT-2 from transformers, SDPA,
  bf16 autocast, fused AdamW, clipping, `torch.compile` of the whole model), one after the other
  in fresh processes, random tokens of the model's vocabulary for both.

Usage: python benchmarks/gpu_suite.py [--sections tests,memory,overlap,speed] [--out DIR]
       [--speed-models A,B,1B] [--budget-s SECONDS]
       [--quick]   (CPU dry run of the machinery: tiny shapes, no timings worth reading)
Writes <out>/gpu-<device>-<date>[-N].md and .json (default out: benchmarks/results).
`--budget-s`: end inside one command of a device lease (benchmarks/gpu_lease.py); how to run
the suite on a lent machine is docs/gpu-suite.md.
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gpu_lease import Budget
from gpu_suite_report import markdown

from onegpu.tools.bench import run_row

SECTIONS = ("tests", "memory", "overlap", "speed")
BASE = {"model.dropout": "0", "data.bin_dtype": "uint16", "train.compile": "none",
        # the peak is the caching allocator's either way: no profiled step, no startup plan
        "train.measure_memory": "false", "train.skip_memory_check": "true"}  # fmt: skip
GPT2 = {"__preset": "gpt2", "train.batch_size": "8", "train.micro_batch_size": "8"}
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
    over = {**BASE, **base, **extra}
    preset = over.pop("__preset", "tiny")
    vocab = int(over.get("model.vocab_size", 50257 if preset.startswith("gpt2") else 256))
    over["data.source"] = str(_tokens_file(work, vocab))
    return preset, over


def _start_plan(preset: str, over: dict[str, str], gpu: str) -> subprocess.Popen:
    """`onegpu plan --json` in the background: it plans on the CPU while the GPU runs."""
    cmd = [sys.executable, "-m", "onegpu", "plan", "--preset", preset, "--json"]
    cmd += ["--gpu", gpu] if gpu else []
    for k, v in over.items():
        cmd += [f"--{k}", v]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _plan_of(proc: subprocess.Popen, timeout: float | None) -> dict[str, Any]:
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        raise RuntimeError(f"{' '.join(proc.args)}: killed at the end of --budget-s") from None
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(proc.args)}: {err.strip()[-800:]}")
    return json.loads(out)


def _worker(job: list[str], args: argparse.Namespace, **kwargs: Any) -> subprocess.CompletedProcess:
    """A child process, killed at the end of the budget (TimeoutExpired: the row fails)."""
    return subprocess.run(
        job, capture_output=True, text=True, timeout=args.budget.timeout(), **kwargs
    )


def section_tests(args: argparse.Namespace) -> dict[str, Any]:
    command = "python -m pytest -m gpu tests"
    if reason := args.budget.skip_reason("tests"):
        return {"command": command, "rc": None, "summary": reason, "tail": []}
    cmd = [sys.executable, "-m", "pytest", "-m", "gpu", "-q", "-p", "no:cacheprovider", "tests"]
    t0 = time.perf_counter()
    try:
        proc = _worker(cmd, args, cwd=Path(__file__).parents[1])
    except subprocess.TimeoutExpired as e:
        tail = (e.stdout or b"").decode(errors="replace").strip().splitlines()[-30:]
        return {"command": command, "rc": None, "summary": "killed at the end of --budget-s",
                "tail": tail, "wall_s": time.perf_counter() - t0}  # fmt: skip
    args.budget.took("tests", time.perf_counter() - t0)
    tail = proc.stdout.strip().splitlines()[-30:]
    return {"command": command, "rc": proc.returncode,
            "summary": tail[-1] if tail else proc.stderr[-300:], "tail": tail,
            "wall_s": time.perf_counter() - t0}  # fmt: skip


def section_memory(args: argparse.Namespace) -> list[dict[str, Any]]:
    rows = []
    base = QUICK if args.quick else GPT2
    for name, extra in MEMORY_GRID:
        preset, over = _overrides(base, extra, args.work)
        if args.quick:  # a CPU's step peak comes from the profiled step
            over["train.measure_memory"] = "true"
        row: dict[str, Any] = {"name": name, "preset": preset, "overrides": extra}
        if reason := args.budget.skip_reason("memory"):
            rows.append(row | {"skipped": reason})
            continue
        t0 = time.perf_counter()
        try:
            planning = _start_plan(preset, over, args.gpu)
            run = run_row(preset, None, over, 4, args.work, timeout_s=args.budget.timeout())
            plan = _plan_of(planning, args.budget.timeout())
            row |= {
                "planned_peak": plan["memory"]["peak"],
                "measured_peak": run["peak_mem_bytes"],
                "kind": run["peak_mem_kind"],
                "error": plan["memory"]["peak"] / run["peak_mem_bytes"] - 1,
                "planned_host": plan.get("host_memory_bytes"),
                "step_time_s": run["step_time_s"],
                "predicted_step_time_s": plan.get("predicted_step_time_s"),
            }
        except Exception as e:  # one configuration's failure is a finding, not the end
            row["failed"] = str(e)[-1500:]
        args.budget.took("memory", time.perf_counter() - t0)
        rows.append(row)
        args.save("memory", rows)
        print(f"memory: {name}: {row.get('error', row.get('failed'))}", flush=True)
    return rows


def _trace_overlap(
    trace: dict[str, Any], host_ns: list[tuple[int, int]], anchor_ns: int
) -> dict[str, float]:
    """One in-backward step: the host steps' total time, and the part of it after the step's
    last GPU kernel (exposed: the GPU waited for the host), in seconds. The host steps run on
    a worker thread the profiler does not follow, so they are timed by `perf_counter_ns` and
    placed on the trace's clock through the `onegpu.anchor` range, marked at `anchor_ns`."""
    events = trace.get("traceEvents", [])
    total = sum(end - start for start, end in host_ns) / 1e9
    kernels = [e for e in events if e.get("cat") == "kernel" and "dur" in e]
    anchors = [e["ts"] for e in events if e.get("name") == "onegpu.anchor"]
    if not host_ns or not kernels or not anchors:
        return {"host_step_s": total, "host_steps": len(host_ns), "exposed_s": float("nan")}
    offset_us = anchor_ns / 1e3 - anchors[0]  # trace ts = perf_counter us - offset
    last_kernel = max(e["ts"] + e["dur"] for e in kernels) + offset_us  # on the host clock, us
    exposed_us = sum(max(0.0, end / 1e3 - max(start / 1e3, last_kernel)) for start, end in host_ns)
    return {"host_step_s": total, "host_steps": len(host_ns), "exposed_s": exposed_us / 1e6}


def _timing_host_steps() -> list[tuple[int, int]]:
    """Every host step from now on, as (start, end) in perf_counter_ns, whatever its thread."""
    from onegpu.offload.host_optimizer import HostOffloadOptimizer

    spans: list[tuple[int, int]] = []
    stepped_copy = HostOffloadOptimizer._stepped_copy

    def timed(self, p):
        start = time.perf_counter_ns()
        try:
            return stepped_copy(self, p)
        finally:
            spans.append((start, time.perf_counter_ns()))

    HostOffloadOptimizer._stepped_copy = timed
    return spans


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
    spans = _timing_host_steps()
    with torch.profiler.profile(activities=activities) as prof:
        anchor_ns = time.perf_counter_ns()
        with torch.profiler.record_function("onegpu.anchor"):
            pass
        built.step(x[:, :-1], x[:, 1:], x[:, 1:].numel(), 3)
        if built.device.type == "cuda":
            torch.cuda.synchronize()
    prof.export_chrome_trace(str(out))
    return _trace_overlap(json.loads(out.read_text()), spans, anchor_ns)


def _overlap_row(args: argparse.Namespace, extra: dict[str, str]) -> dict[str, Any]:
    preset, over = _overrides(QUICK if args.quick else GPT2, extra, args.work)
    run = run_row(preset, None, over, 12, args.work, timeout_s=args.budget.timeout())
    return {"step_time_s": run["step_time_s"], "peak": run["peak_mem_bytes"]}


def _overlap_trace(args: argparse.Namespace) -> dict[str, Any]:
    extra = OVERLAP_ROWS["optimizer on the host, in backward"]
    preset, over = _overrides(QUICK if args.quick else GPT2, extra, args.work)
    trace = args.work / "host-step-trace.json"
    cmd = [sys.executable, __file__, "--profile-worker", json.dumps([preset, over, str(trace)])]
    proc = _worker(cmd, args)
    if proc.returncode != 0:
        raise RuntimeError(proc.stderr[-1500:])
    return json.loads(proc.stdout.strip().splitlines()[-1])


def section_overlap(args: argparse.Namespace) -> dict[str, Any]:
    """Each row, then the trace; a row that fails or does not fit is said so, the rest go on."""
    result: dict[str, Any] = {"rows": {}}
    jobs = {name: (lambda e=extra: _overlap_row(args, e)) for name, extra in OVERLAP_ROWS.items()}
    jobs["trace"] = lambda: _overlap_trace(args)
    for name, job in jobs.items():
        if reason := args.budget.skip_reason("overlap"):
            value: dict[str, Any] = {"skipped": reason}
        else:
            t0 = time.perf_counter()
            try:
                value = job()
            except Exception as e:  # TimeoutExpired included: the budget ended it
                value = {"failed": str(e)[-1500:]}
            args.budget.took("overlap", time.perf_counter() - t0)
        if name == "trace":
            result["trace"] = value
        else:
            result["rows"][name] = value
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
    loop killed by the budget keeps onegpu's half)."""
    name, shape = row["model"], row["shape"]
    steps = 12 if args.quick else (20 if name == "1B" else 30)
    preset, over = _overrides({}, _model_overrides(shape), args.work)
    if not args.quick:  # onegpu's defaults decide, as for a long run
        over.pop("train.compile")
    planning = _start_plan(preset, over, args.gpu)
    one = run_row(preset, None, over, steps, args.work, timeout_s=args.budget.timeout(),
                  horizon=HORIZON)  # fmt: skip
    plan = _plan_of(planning, args.budget.timeout())
    row["onegpu"] = {"tokens_per_s": one["tokens_per_s"], "mfu": one["mfu"],
                     "peak": one["peak_mem_bytes"], "compile_time_s": one["compile_time_s"],
                     "compile": one["compile"],
                     "planned_peak": plan["memory"]["peak"],
                     "predicted_tokens_per_s": plan["predicted_tokens_per_s"]}  # fmt: skip
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
        row: dict[str, Any] = {"model": name, "shape": shape}
        if reason := args.budget.skip_reason("speed"):
            row["skipped"] = reason
        else:
            t0 = time.perf_counter()
            try:
                _speed_row(args, row)
            except Exception as e:  # TimeoutExpired included: the budget ended it
                row["failed"] = str(e)[-1500:]
            args.budget.took("speed", time.perf_counter() - t0)
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
    run = {"tests": section_tests, "memory": section_memory, "overlap": section_overlap,
           "speed": section_speed}  # fmt: skip

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
