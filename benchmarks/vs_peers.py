"""Head-to-head: `onegpu train` with its defaults against transformers.Trainer and a plain
hand-written PyTorch loop, each with its own allocator and once more with the fast one.

    python benchmarks/vs_peers.py --model B [--rounds 2] [--steps 11] [--only a,b,...]

Models (the same token stream, windows, global batch and optimizer family for every contestant):
- A: the `seed-ref` preset (seed 003's reference): 4 x d256, 4 heads, seq 512, a byte-level BPE
  of 50,257 tokens trained locally, batch 8, no dropout.
- B: 6 x d384, 6 heads, seq 256, a BPE of 8,192 tokens, batch 16, no dropout.
- B12: B at 12 layers (GPT-2 124M's depth): deeper than dynamo's recompile limit of 8, where a
  compile that treated each block as new would leave the last ones eager.
- small: the default `onegpu train` model (byte vocabulary).

Contestants, each in a fresh process, rounds interleaved, medians over rounds (or, with
--paired, all alive at once and timed in turns: benchmarks/paired.py):
- onegpu: `onegpu train` and only the model's flags: every `auto` default (precision,
  attention, loss chunk, compile) and the allocator a fresh machine gets from `pip install`
  (mimalloc from the cmeel-mimalloc wheel; ONEGPU_ALLOCATOR=mimalloc here, where tcmalloc is
  also installed). The run is a real 200-step run (the defaults' schedule and `auto` choices),
  stopped with SIGTERM once enough steps are timed. A first, uncounted run fills onegpu's
  per-machine caches (tokenizer, attention, loss chunk and compile timings), as any first run
  on a machine does.
- onegpu-long: the same as a 5,000-step run (stopped as early): `auto` decides for a long run.
- hf, hf-compile: `Trainer` on `GPT2LMHeadModel` (SDPA), `adamw_torch_fused`, bf16 where the
  CPU runs it natively (else fp32), no eval, no saving; hf-compile adds `torch_compile=True`.
- plain, plain-compile: the same model in a hand-written loop: autocast where bf16 is native,
  fused AdamW, clipping, and for plain-compile `torch.compile(model)`.
- name+tcmalloc: the contestant with tcmalloc preloaded (onegpu: ONEGPU_ALLOCATOR=tcmalloc), so
  the allocator's share is visible; plain-compile+mimalloc: the loop on the allocator onegpu
  brings, preloaded exactly as onegpu does. Without a suffix a peer runs on glibc's malloc.

tokens/s: batch tokens / the median step time after WARM steps; peak RSS: the process's
ru_maxrss, the same view for every contestant; x floor: the step over the model's matmul floor
on this machine (perf/floor.py); with --paired also x floor in turns: the step over the same
products run pass after pass in turns beside it (benchmarks/floor_turns.py), which a floor
cached from a fast moment of a drifting VM does not skew; MFU against the measured matmul peak.
Writes
results/vs-peers-<model>[-bf16][-contestants]-<date>[-N].{md,json} (-bf16 where the CPU
multiplies bf16 natively and every contestant runs bf16; -N: never over an earlier file).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import resource
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from onegpu.perf.allocator import MIMALLOC_PURGE, find_mimalloc, find_tcmalloc
from onegpu.perf.devices import cpu_identity

sys.path.insert(0, str(Path(__file__).parent))
import floor_turns  # noqa: E402
import paired  # noqa: E402
from paired import DROPPED, Contestant, ratio, run_in_turns, spread, step_time  # noqa: E402

RESULTS = Path(__file__).parent / "results"
WARM = 3  # steps left out of the timing (compilation, allocator growth)
ONEGPU_STEPS = 200  # the run onegpu's defaults are measured in (stopped early)
MODELS = {
    "A": {"args": ["--preset", "seed-ref", "--model.dropout", "0", "--train.batch_size", "8",
                   "--train.micro_batch_size", "8"],
          "preset": "seed-ref", "over": {"model.dropout": "0"},
          "shape": dict(n_layer=4, n_head=4, d_model=256, seq_len=512, vocab_size=50257), "batch": 8},
    "B": {"args": ["--model.n_layer", "6", "--model.d_model", "384", "--model.n_head", "6",
                   "--model.seq_len", "256", "--model.vocab_size", "8192", "--data.tokenizer", "bpe",
                   "--model.dropout", "0", "--train.batch_size", "16", "--train.micro_batch_size", "16"],
          "preset": "small", "over": {"model.vocab_size": "8192", "data.tokenizer": "bpe"},
          "shape": dict(n_layer=6, n_head=6, d_model=384, seq_len=256, vocab_size=8192), "batch": 16},
    "B12": {"args": ["--model.n_layer", "12", "--model.d_model", "384", "--model.n_head", "6",
                     "--model.seq_len", "256", "--model.vocab_size", "8192", "--data.tokenizer", "bpe",
                     "--model.dropout", "0", "--train.batch_size", "16", "--train.micro_batch_size", "16"],
            "preset": "small", "over": {"model.vocab_size": "8192", "data.tokenizer": "bpe",
                                        "model.n_layer": "12"},
            "shape": dict(n_layer=12, n_head=6, d_model=384, seq_len=256, vocab_size=8192), "batch": 16},
    "small": {"args": [], "preset": "small", "over": {},
              "shape": dict(n_layer=6, n_head=4, d_model=256, seq_len=256, vocab_size=256), "batch": 16},
}  # fmt: skip
LR, WD, CLIP, WARMUP_STEPS = 1e-3, 0.1, 1.0, 20
CONTESTANTS = ("onegpu", "onegpu+tcmalloc", "onegpu-long", "onegpu-long+tcmalloc", "onegpu-jax",
               "hf", "hf-compile", "hf+tcmalloc", "plain", "plain-compile", "plain-compile+tcmalloc",
               "plain-compile+mimalloc")  # fmt: skip
"""onegpu-jax: the same `onegpu train` on the JAX backend (issue 24; needs the jax extra).
onegpu-long: the same `onegpu train` as a 5,000-step run (stopped as early), so `auto` decides
for a long run: it compiles what repays its compile over 5,000 steps, not 200."""
ONEGPU_RUNS = {"onegpu": ("torch", ONEGPU_STEPS), "onegpu-jax": ("jax", ONEGPU_STEPS),
               "onegpu-long": ("torch", 5000)}  # fmt: skip
"""Each onegpu contestant: its backend and the run length `auto` decides for."""
DEFAULT = ("onegpu", "onegpu+tcmalloc", "onegpu-long+tcmalloc", "plain-compile+mimalloc",
           "plain-compile+tcmalloc", "plain-compile", "hf")  # fmt: skip
"""The head-to-head of issue 30: onegpu on the allocator a fresh machine gets and on tcmalloc,
its 5,000-step run on tcmalloc, the compiled hand-written loop on each of those allocators (the same one onegpu has) and on
glibc, Trainer."""


def _precision() -> str:
    """The precision onegpu's `auto` runs here, which the peers and the floor run too."""
    from onegpu.techniques.precision import resolve_precision

    return resolve_precision("auto", torch.device("cpu")).name


def _hf_model(model: str):
    from transformers import GPT2Config, GPT2LMHeadModel

    s = MODELS[model]["shape"]
    cfg = GPT2Config(n_layer=s["n_layer"], n_head=s["n_head"], n_embd=s["d_model"],
                     n_positions=s["seq_len"], vocab_size=s["vocab_size"], resid_pdrop=0.0,
                     embd_pdrop=0.0, attn_pdrop=0.0, attn_implementation="sdpa")  # fmt: skip
    torch.manual_seed(1337)
    return GPT2LMHeadModel(cfg)


def _windows(model: str):
    """The token windows onegpu trains on (its own data path: same tokens, same split)."""
    from onegpu.backends.torch.loader import PackedSequences
    from onegpu.config import load_config
    from onegpu.data.tokens import prepare_tokens

    cfg = load_config(MODELS[model]["preset"], overrides=MODELS[model]["over"])
    splits = prepare_tokens(cfg.data, cfg.model.vocab_size)
    return PackedSequences(splits.cut(cfg.data, MODELS[model]["shape"]["seq_len"]).train_rows)


def _schedule(step: int, steps: int) -> float:
    if step < WARMUP_STEPS:
        return (step + 1) / WARMUP_STEPS
    p = (step - WARMUP_STEPS) / max(1, steps - WARMUP_STEPS)
    return 0.1 + 0.45 * (1 + math.cos(math.pi * p))


def run_plain(model_name: str, steps: int, compile_: bool, on_step=None) -> list[float]:
    model, data, batch = _hf_model(model_name), _windows(model_name), MODELS[model_name]["batch"]
    order = torch.randperm(len(data), generator=torch.Generator().manual_seed(1337))
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2 and "wte" not in n]
    rest = [p for n, p in model.named_parameters() if not (p.ndim >= 2 and "wte" not in n)]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": WD}, {"params": rest, "weight_decay": 0.0}],
                            lr=LR, betas=(0.9, 0.95), fused=True)  # fmt: skip
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: _schedule(s, steps))
    forward = torch.compile(model) if compile_ else model
    bf16 = _precision() == "bf16"
    times = []
    for step in range(steps):
        t0 = time.perf_counter()
        x = torch.stack([data[i][0] for i in order[step * batch : (step + 1) * batch].tolist()])
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            loss = forward(input_ids=x, labels=x).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        loss.item()
        times.append(time.perf_counter() - t0)
        if on_step:
            on_step(times[-1])
    return times


def run_hf(model_name: str, steps: int, compile_: bool, on_step=None) -> list[float]:
    from transformers import Trainer, TrainerCallback, TrainingArguments

    data = _windows(model_name)

    class Windows(torch.utils.data.Dataset):
        def __len__(self):
            return len(data)

        def __getitem__(self, i):
            return {"input_ids": data[i][0], "labels": data[i][0]}

    times: list[float] = []

    class Clock(TrainerCallback):
        def on_step_begin(self, args, state, control, **kw):
            self.t0 = time.perf_counter()

        def on_step_end(self, args, state, control, **kw):
            times.append(time.perf_counter() - self.t0)
            if on_step:
                on_step(times[-1])

    with tempfile.TemporaryDirectory() as out:
        args = TrainingArguments(
            output_dir=out, use_cpu=True, bf16=_precision() == "bf16",
            per_device_train_batch_size=MODELS[model_name]["batch"], max_steps=steps,
            learning_rate=LR, weight_decay=WD, adam_beta2=0.95, max_grad_norm=CLIP,
            warmup_steps=WARMUP_STEPS, lr_scheduler_type="cosine", optim="adamw_torch_fused",
            torch_compile=compile_, logging_steps=10, save_strategy="no", eval_strategy="no",
            report_to="none", dataloader_num_workers=0, disable_tqdm=True, seed=1337,
        )  # fmt: skip
        Trainer(model=_hf_model(model_name), args=args, train_dataset=Windows(),
                callbacks=[Clock()]).train()  # fmt: skip
    return times


def onegpu_command(model: str, out: str | Path, kind: str = "onegpu") -> list[str]:
    """The `onegpu train` of contestant `kind` (ONEGPU_RUNS) logging every step to
    out/metrics.jsonl."""
    backend, steps = ONEGPU_RUNS[kind]
    return [sys.executable, "-m", "onegpu", "train", *MODELS[model]["args"], "--out.dir", str(out),
            "--train.backend", backend,
            "--train.max_steps", str(steps), "--train.log_every", "1",
            "--train.eval_every", "0", "--train.measure_memory", "false",
            "--out.progress", "false", "--out.save_checkpoint", "false"]  # fmt: skip


def onegpu_choices(summary: dict) -> dict:
    """What the run's summary.json says onegpu ran with: allocator, precision, `auto`'s picks."""
    cfg = summary["config"]
    return {"allocator": summary.get("allocator") or summary["environment"].get("allocator", "?"),
            "precision": summary["precision"], "compile_time_s": summary.get("compile_time_s"),
            "chosen": f"loss_chunk {cfg['memory']['loss_chunk']}, "
                      f"loss_kernel {cfg['train'].get('loss_kernel', 'eager')}, "
                      f"gelu_kernel {cfg['train'].get('gelu_kernel', 'eager')}, "
                      f"compile {cfg['train']['compile']}, attention {cfg['model']['attention']}"}  # fmt: skip


def run_onegpu(model: str, steps: int, env: dict[str, str], kind: str = "onegpu") -> dict:
    """A 200-step `onegpu train` (5,000 for onegpu-long), stopped by SIGTERM (a graceful stop)
    after `steps` steps."""
    with tempfile.TemporaryDirectory() as out:
        cmd = onegpu_command(model, out, kind)
        metrics = Path(out) / "metrics.jsonl"
        proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        while proc.poll() is None:
            if metrics.exists() and len(metrics.read_text().splitlines()) >= steps:
                proc.send_signal(signal.SIGTERM)
                break
            time.sleep(0.2)
        _, err = proc.communicate()
        if not (Path(out) / "summary.json").exists():
            sys.exit(f"onegpu failed:\n{err.decode()[-3000:]}")
        rows = [json.loads(x) for x in metrics.read_text().splitlines()]
        summary = json.loads((Path(out) / "summary.json").read_text())
    times = [r["step_time_s"] for r in rows if "step_time_s" in r][:steps]
    return {"times": times, "peak_rss_bytes": summary["peak_mem_bytes"]} | onegpu_choices(summary)


def worker(name: str, model: str, steps: int, steps_file: str | None = None) -> dict:
    """One peer's run; with `steps_file`, each step's time is also written there as it ends
    (one JSON line, flushed: what benchmarks/paired.py reads)."""
    kind, compile_ = name.removesuffix("-compile"), name.endswith("-compile")
    log = open(steps_file, "a") if steps_file else None  # noqa: SIM115 (open for the whole run)

    def on_step(seconds: float) -> None:
        log.write(json.dumps({"step_time_s": seconds}) + "\n")
        log.flush()

    times = (run_plain if kind == "plain" else run_hf)(
        model, steps, compile_, on_step if log else None
    )
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return {"times": times, "peak_rss_bytes": peak, "precision": _precision()}


def environment(name: str) -> dict[str, str]:
    """The contestant's environment: its allocator (onegpu's own setting, or a preload)."""
    base, _, preload = name.partition("+")
    env = dict(os.environ)
    env.pop("LD_PRELOAD", None)
    if base in ONEGPU_RUNS:  # both backends on the allocator a fresh machine gets
        env["ONEGPU_ALLOCATOR"] = "tcmalloc" if preload == "tcmalloc" else "mimalloc"
        return env
    env["ONEGPU_ALLOCATOR"] = "system"  # the worker imports onegpu for its data: no preload
    if preload == "tcmalloc":
        env["LD_PRELOAD"] = find_tcmalloc() or ""
    elif preload == "mimalloc":  # exactly as onegpu preloads it
        env["LD_PRELOAD"] = find_mimalloc() or ""
        env[MIMALLOC_PURGE] = "-1"
    return env


def worker_command(name: str, model: str, steps: int, steps_file: Path | None = None) -> list[str]:
    base = name.partition("+")[0]
    cmd = [sys.executable, __file__, "--worker", base, "--model", model, "--steps", str(steps)]
    return cmd + (["--steps-file", str(steps_file)] if steps_file else [])


def with_rates(res: dict, model: str, step: float) -> dict:
    """`res` with its step time, tokens/s and first step's excess over a steady step (compile
    time, the same view for every contestant)."""
    tokens = MODELS[model]["batch"] * MODELS[model]["shape"]["seq_len"]
    first = max(0.0, res["times"][0] - step)
    return res | {"step_time_s": step, "tokens_per_s": tokens / step, "first_step_excess_s": first}


def run(name: str, model: str, steps: int) -> dict:
    base, _, preload = name.partition("+")
    env = environment(name)
    if base in ONEGPU_RUNS:
        res = run_onegpu(model, steps, env, kind=base)
    else:
        proc = subprocess.run(
            worker_command(name, model, steps), capture_output=True, text=True, env=env
        )
        if proc.returncode != 0:
            sys.exit(f"{name} failed:\n{proc.stderr[-3000:]}")
        res = json.loads(proc.stdout.strip().splitlines()[-1])
        res["allocator"] = preload or "glibc"
    return with_rates(res, model, statistics.median(res["times"][WARM:]))


def check_paired_steps(cycles: int, turn_steps: int) -> None:
    """Exit with one line where the turns would need more steps than onegpu's run has."""
    needed = WARM + cycles * (turn_steps + DROPPED + 1)  # +1: a turn may finish one more
    if needed > ONEGPU_STEPS:
        sys.exit(f"--cycles and --turn-steps need about {needed} steps; onegpu runs {ONEGPU_STEPS}")


def run_paired(names: list[str], model: str, cycles: int, turn_steps: int) -> dict[str, dict]:
    """Every contestant alive at once, timed in turns (benchmarks/paired.py); each one's result
    as `run` gives it, plus `paired`: how many times faster it ran than each other contestant."""
    check_paired_steps(cycles, turn_steps)
    with tempfile.TemporaryDirectory() as tmp:
        contestants = []
        for n in names:
            folder = Path(tmp) / n
            folder.mkdir()
            base = n.partition("+")[0]
            if base in ONEGPU_RUNS:
                cmd = onegpu_command(model, folder, base)
                steps_file = folder / "metrics.jsonl"
            else:
                steps_file = folder / "steps.jsonl"
                cmd = worker_command(n, model, ONEGPU_STEPS, steps_file)
            contestants.append(Contestant(n, cmd, environment(n), steps_file))
        floor = floor_contestant(model, [], Path(tmp) / "floor.jsonl")
        at = 1 + max(
            (i for i, c in enumerate(contestants) if c.name.startswith("onegpu")), default=-1
        )
        turns = [*contestants[:at], floor, *contestants[at:]]  # beside onegpu's rows
        run_in_turns(turns, WARM, cycles, turn_steps, log=lambda m: print(m, flush=True))
        results = {}
        for c in contestants:
            summary = c.steps_file.parent / "summary.json"
            if summary.exists():
                res = onegpu_choices(json.loads(summary.read_text()))
            else:
                res = {"allocator": c.name.partition("+")[2] or "glibc", "precision": _precision()}
            res |= {"times": c.steps(), "turns": c.turns, "peak_rss_bytes": c.peak_rss_bytes}
            res = with_rates(res, model, step_time(c))
            results[c.name] = res | {
                "paired": {o.name: ratio(c, o) for o in contestants},
                "spread": {o.name: spread(c, o) for o in contestants},
                "floor_in_turns": {"x": ratio(floor, c), "spread": spread(floor, c),
                                   "floor_s": step_time(floor), "turns": floor.turns},
            }  # fmt: skip
    return results


def floor_contestant(model: str, extra: list[str], steps_file: Path) -> Contestant:
    """The step's products pass after pass, timed in turns beside the steps
    (benchmarks/floor_turns.py), on the allocator onegpu prefers here."""
    allocator = "tcmalloc" if find_tcmalloc() else "mimalloc"
    env = environment(f"floor+{allocator}")
    cmd = floor_turns.command(model, extra, steps_file)
    return Contestant(floor_turns.NAME, cmd, env, steps_file)


def model_config(model: str, extra: list[str] | tuple[str, ...] = ()):
    """onegpu's config of the model on this CPU, with `extra` `--section.key value` flags."""
    from onegpu.config import load_config

    over = MODELS[model]["over"] | {"train.precision": _precision(), "train.device": "cpu"}
    flags = [*MODELS[model]["args"], *extra]
    for flag, value in zip(flags[::2], flags[1::2]):
        if flag.startswith("--") and "." in flag:
            over[flag[2:]] = value
    return load_config(MODELS[model]["preset"], overrides=over)


def model_floor(model: str, extra: list[str] | tuple[str, ...] = ()) -> dict[str, float]:
    """The model's matmul floor on this machine (perf/floor.py: every product of onegpu's step
    at the shapes and precision every contestant runs, timed alone), its FLOPs per token
    (6 per weight, attention's 12 L T d) and the matmul peak MFU divides by. `extra`: more
    `--section.key value` flags (a cut's settings: blocked attention has its own products)."""
    from onegpu.backends.torch.floor import step_floor
    from onegpu.perf.devices import cpu_peak_flops
    from onegpu.perf.flops import attention_flops_per_token

    cfg = model_config(model, extra)
    s = MODELS[model]["shape"]
    weights = s["n_layer"] * 12 * s["d_model"] ** 2 + s["vocab_size"] * s["d_model"]
    attention = attention_flops_per_token(s["n_layer"], s["seq_len"], s["d_model"])
    dtype = torch.bfloat16 if _precision() == "bf16" else torch.float32
    return {
        "floor_s": step_floor(cfg, torch.device("cpu")).seconds,
        "flops_per_token": 6 * weights + attention,
        "peak_flops": cpu_peak_flops(dtype),
    }


def _ratio_cell(m: dict, other: dict, name: str) -> str:
    """`m` over `other`: paired, the median of the cycles' ratios and their quartiles."""
    if "paired" not in m:
        return f"{m['tokens_per_s'] / other['tokens_per_s']:.2f}"
    q1, q3 = m["spread"][name]
    return f"{m['paired'][name]:.2f} ({q1:.2f}-{q3:.2f})"


def _floor_pass(med: dict[str, dict]) -> str:
    passes = [m["floor_in_turns"]["floor_s"] for m in med.values() if "floor_in_turns" in m]
    return f"its median pass {passes[0] * 1e3:,.1f} ms" if passes else "paired runs only"


def _in_turns(m: dict) -> str:
    """The step over the floor's pass in the same cycles (benchmarks/floor_turns.py)."""
    if "floor_in_turns" not in m:
        return "-"
    f = m["floor_in_turns"]
    return "{:.2f}x ({:.2f}-{:.2f})".format(f["x"], *f["spread"])


def _counts(a: argparse.Namespace) -> str:
    if a.paired:
        return paired.flags(a)
    return f"--rounds {a.rounds} --steps {a.steps}"


def _method(a: argparse.Namespace) -> str:
    if a.paired:
        return (
            f"every contestant alive at once and timed in turns (benchmarks/paired.py): "
            f"{a.cycles} cycles of {a.turn_steps} clean steps each; tokens/s from the median "
            "step, ratios the median over cycles of each cycle's ratio"
        )
    return f"medians of {a.rounds} interleaved rounds of {a.steps - WARM} steady steps"


def table(model: str, med: dict[str, dict], a: argparse.Namespace, floor: dict) -> str:
    ref = {k: max((n for n in med if n.startswith(k) and "+" not in n), default=None,
                  key=lambda n: med[n]["tokens_per_s"]) for k in ("hf", "plain")}  # fmt: skip
    cols = [r for r in ref.values() if r] or [n for n in ("onegpu",) if n in med]
    for loop in ("plain-compile+mimalloc", "plain-compile+tcmalloc"):  # onegpu's allocators
        if loop in med:
            cols.append(loop)
    lines = [
        f"# onegpu vs transformers.Trainer vs a hand-written loop: model {model}",
        "",
        f"`python benchmarks/vs_peers.py --model {model} {_counts(a)}"
        + (f" --only {a.only}" if tuple(a.only.split(",")) != DEFAULT else "")
        + "`; "
        f"{platform.machine()}, {os.cpu_count()} cores ({cpu_identity()}), "
        f"torch {torch.__version__}, precision {_precision()}; {_method(a)}; "
        f"{time.strftime('%Y-%m-%d')}. Model: "
        f"{MODELS[model]['shape']}, batch {MODELS[model]['batch']}. Ratios against the best "
        "setting of each peer on its own allocator. First step: its excess over a steady step "
        "(compilation, for the compiled ones). Floor: the step's matmul floor on this machine "
        f"({floor['floor_s'] * 1e3:,.1f} ms: every product of the step timed alone, "
        "perf/floor.py); x floor: the step time over it; x floor in turns: over the same "
        "products run pass after pass in turns with the steps (benchmarks/floor_turns.py: "
        f"{_floor_pass(med)}), the median over cycles (quartiles). MFU: "
        f"{floor['flops_per_token'] / 1e6:,.1f} MFLOP a token over the measured "
        f"{_precision()} matmul peak, {floor['peak_flops'] / 1e9:,.0f} GFLOP/s.",
        "",
        "| contestant | allocator | precision | tokens/s | "
        + " | ".join(f"x {c}" for c in cols)
        + " | step | x floor | x floor in turns | MFU | peak RSS | first step |",
        "|---|---|---|---|" + "---|" * len(cols) + "---|---|---|---|---|---|",
    ]
    tokens = MODELS[model]["batch"] * MODELS[model]["shape"]["seq_len"]
    for n, m in med.items():
        ratios = " | ".join(_ratio_cell(m, med[c], c) for c in cols)
        step_s = tokens / m["tokens_per_s"]
        mfu = m["tokens_per_s"] * floor["flops_per_token"] / floor["peak_flops"]
        lines.append(f"| {n} | {m['allocator']} | {m['precision']} | {m['tokens_per_s']:,.0f} "
                     f"| {ratios} | {step_s * 1e3:,.0f} ms | {step_s / floor['floor_s']:.2f}x "
                     f"| {_in_turns(m)} | {mfu:.0%} | {m['peak_rss_bytes'] / 2**20:,.0f} MiB "
                     f"| +{m['first_step_excess_s']:.1f} s |")  # fmt: skip
    chosen = [f"{n}: {m['chosen']}" for n, m in med.items() if "chosen" in m]
    if chosen:
        lines += ["", "onegpu's `auto` chose (each onegpu contestant): " + "; ".join(chosen) + "."]
    return "\n".join(lines) + "\n"


def run_rounds(names: list[str], a: argparse.Namespace) -> tuple[dict, dict]:
    """Each contestant once a round in a fresh process, rounds interleaved; every run, and the
    medians over rounds."""
    runs: dict[str, list[dict]] = {n: [] for n in names}
    for r in range(a.rounds):
        for n in names:  # interleaved: a slow moment of the shared machine hits every contestant
            runs[n].append(run(n, a.model, a.steps))
            print(f"round {r + 1} {n}: {runs[n][-1]['tokens_per_s']:,.0f} tokens/s, "
                  f"{runs[n][-1]['peak_rss_bytes'] / 2**20:,.0f} MiB", flush=True)  # fmt: skip
    med = {
        n: {"tokens_per_s": statistics.median(x["tokens_per_s"] for x in rs),
            "peak_rss_bytes": statistics.median(x["peak_rss_bytes"] for x in rs),
            "first_step_excess_s": statistics.median(x["first_step_excess_s"] for x in rs),
            "allocator": rs[0]["allocator"], "precision": rs[0]["precision"],
            **({"chosen": rs[0]["chosen"]} if "chosen" in rs[0] else {})}
        for n, rs in runs.items()
    }  # fmt: skip
    return runs, med


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", default="B", choices=sorted(MODELS))
    ap.add_argument("--steps", type=int, default=11)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--only", default=",".join(DEFAULT), help=f"of {','.join(CONTESTANTS)}")
    paired.add_arguments(ap)
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--steps-file", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.worker:
        print(json.dumps(worker(a.worker, a.model, a.steps, a.steps_file)))
        return
    names = [n for n in a.only.split(",") if find_tcmalloc() or not n.endswith("+tcmalloc")]
    if "onegpu" in names and not find_mimalloc():
        sys.exit("the cmeel-mimalloc wheel is missing: pip install -e . brings it")
    for kind in dict.fromkeys(n.partition("+")[0] for n in names if n.startswith("onegpu")):
        run(kind, a.model, WARM + 1)  # fills the per-machine caches (each run length's), uncounted
    floor = model_floor(a.model)  # timed (where missing) before the contestants run
    if a.paired:
        med = run_paired(names, a.model, a.cycles, a.turn_steps)
        runs = {n: [m] for n, m in med.items()}
    else:
        runs, med = run_rounds(names, a)
    text = table(a.model, med, a, floor)
    RESULTS.mkdir(parents=True, exist_ok=True)
    stem = f"vs-peers-{a.model}" + ("-bf16" if _precision() == "bf16" else "")
    stem += "-paired" if a.paired else ""
    if tuple(names) != DEFAULT:  # a subset or other contestants: not the head-to-head's file
        stem += "-" + "-".join(n.replace("+", "-") for n in names)
    stem = _new_stem(f"{stem}-{time.strftime('%Y-%m-%d')}")
    (RESULTS / f"{stem}.md").write_text(text)
    record = {"runs": runs, "median": med, "floor": floor, "cpu": cpu_identity()}
    (RESULTS / f"{stem}.json").write_text(json.dumps(record, indent=1))
    print(text)


def _new_stem(stem: str) -> str:
    """A dated name no earlier result has: results are records, never overwritten."""
    n, found = 1, stem
    while (RESULTS / f"{found}.md").exists() or (RESULTS / f"{found}.json").exists():
        n += 1
        found = f"{stem}-{n}"
    return found


if __name__ == "__main__":
    main()
