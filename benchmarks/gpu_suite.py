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
       [--quick]   (CPU dry run of the machinery: tiny shapes, no timings worth reading)
Writes <out>/gpu-<device>-<date>[-N].md and .json (default out: benchmarks/results).
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


def _plan_of(proc: subprocess.Popen) -> dict[str, Any]:
    out, err = proc.communicate()
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(proc.args)}: {err.strip()[-800:]}")
    return json.loads(out)


def section_tests(args: argparse.Namespace) -> dict[str, Any]:
    cmd = [sys.executable, "-m", "pytest", "-m", "gpu", "-q", "-p", "no:cacheprovider", "tests"]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=Path(__file__).parents[1])
    tail = proc.stdout.strip().splitlines()[-30:]
    return {"command": "python -m pytest -m gpu tests", "rc": proc.returncode,
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
        try:
            planning = _start_plan(preset, over, args.gpu)
            run = run_row(preset, None, over, 4, args.work)
            plan = _plan_of(planning)
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
        rows.append(row)
        args.save("memory", rows)
        print(f"memory: {name}: {row.get('error', row.get('failed'))}", flush=True)
    return rows


def _trace_overlap(trace: dict[str, Any]) -> dict[str, float]:
    """From a chrome trace of one in-backward step: the host steps' total time, the part of it
    after the step's last GPU kernel (exposed: the GPU waited for the host), both in seconds."""
    events = trace.get("traceEvents", [])
    host = [e for e in events if e.get("name") == "onegpu.host_step" and "dur" in e]
    kernels = [e for e in events if e.get("cat") == "kernel" and "dur" in e]
    total = sum(e["dur"] for e in host) / 1e6
    if not host or not kernels:
        return {"host_step_s": total, "host_steps": len(host), "exposed_s": float("nan")}
    last_kernel = max(e["ts"] + e["dur"] for e in kernels)
    exposed = sum(max(0.0, e["ts"] + e["dur"] - max(e["ts"], last_kernel)) for e in host) / 1e6
    return {"host_step_s": total, "host_steps": len(host), "exposed_s": exposed}


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
    with torch.profiler.profile(activities=activities) as prof:
        built.step(x[:, :-1], x[:, 1:], x[:, 1:].numel(), 3)
        if built.device.type == "cuda":
            torch.cuda.synchronize()
    prof.export_chrome_trace(str(out))
    return _trace_overlap(json.loads(out.read_text()))


def section_overlap(args: argparse.Namespace) -> dict[str, Any]:
    base = QUICK if args.quick else GPT2
    rows = {}
    for name, extra in OVERLAP_ROWS.items():
        preset, over = _overrides(base, extra, args.work)
        run = run_row(preset, None, over, 12, args.work)
        rows[name] = {"step_time_s": run["step_time_s"], "peak": run["peak_mem_bytes"]}
    preset, over = _overrides(base, OVERLAP_ROWS["optimizer on the host, in backward"], args.work)
    trace = args.work / "host-step-trace.json"
    cmd = [sys.executable, __file__, "--profile-worker", json.dumps([preset, over, str(trace)])]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        return {"rows": rows, "trace_failed": proc.stderr[-1500:]}
    return {"rows": rows, "trace": json.loads(proc.stdout.strip().splitlines()[-1])}


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


def section_speed(args: argparse.Namespace) -> list[dict[str, Any]]:
    rows = []
    models = {"quick": QUICK_SPEED} if args.quick else SPEED_MODELS
    for name, shape in models.items():
        steps = 12 if args.quick else (20 if name == "1B" else 30)
        extra = _model_overrides(shape)
        preset, over = _overrides({}, extra, args.work)
        over.pop("train.compile")  # onegpu's defaults decide
        row: dict[str, Any] = {"model": name, "shape": shape}
        tokens = shape["batch"] * shape["seq_len"]
        try:
            planning = _start_plan(preset, over, args.gpu)
            one = run_row(preset, None, over, steps, args.work)
            plan = _plan_of(planning)
            row["onegpu"] = {"tokens_per_s": one["tokens_per_s"], "mfu": one["mfu"],
                             "peak": one["peak_mem_bytes"], "compile_time_s": one["compile_time_s"],
                             "planned_peak": plan["memory"]["peak"],
                             "predicted_tokens_per_s": plan["predicted_tokens_per_s"]}  # fmt: skip
            job = json.dumps([shape, steps, over["data.source"]])
            proc = subprocess.run([sys.executable, __file__, "--loop-worker", job],
                                  capture_output=True, text=True)  # fmt: skip
            if proc.returncode != 0:
                raise RuntimeError(f"loop: {proc.stderr[-1500:]}")
            loop = json.loads(proc.stdout.strip().splitlines()[-1])
            step = statistics.median(loop["times"][5:])
            speedup = tokens / step / one["tokens_per_s"]  # the same FLOPs per token
            row["loop"] = {"tokens_per_s": tokens / step, "peak": loop["peak"],
                           "mfu": one["mfu"] * speedup if one["mfu"] else None,
                           "first_step_s": loop["times"][0]}  # fmt: skip
            row["ratio"] = row["onegpu"]["tokens_per_s"] / row["loop"]["tokens_per_s"]
        except Exception as e:
            row["failed"] = str(e)[-1500:]
        rows.append(row)
        args.save("speed", rows)
        print(f"speed: {name}: {row.get('ratio', row.get('failed'))}", flush=True)
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
    if not args.gpu and torch.cuda.is_available():  # the table's row for this GPU
        from onegpu.perf.devices import gpu_spec_for

        spec = gpu_spec_for(torch.cuda.get_device_name())
        args.gpu = spec.name if spec else ""
    args.out.mkdir(parents=True, exist_ok=True)
    args.work = Path(tempfile.mkdtemp(prefix="gpu-suite-"))
    results: dict[str, Any] = {"environment": _environment(), "command": " ".join(sys.argv),
                               "planned_for": args.gpu or "this machine"}  # fmt: skip
    path = _result_path(args.out, results["environment"]["device"])
    run = {"tests": section_tests, "memory": section_memory, "overlap": section_overlap,
           "speed": section_speed}  # fmt: skip

    def save(section: str, value: Any) -> None:
        """Write what is measured so far: a run cut short keeps every finished row."""
        results[section] = value
        path.write_text(markdown(results))
        path.with_suffix(".json").write_text(json.dumps(results, indent=1, default=str))

    args.save = save
    for name in args.sections.split(","):
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
