"""Head-to-head: onegpu's defaults against transformers.Trainer and a plain PyTorch loop.

Same model shapes (the `small` preset: GPT-2 architecture, 6 x d256, 4 heads, byte vocabulary,
seq 256), same token stream and windows, same global batch (16 sequences), same precision
(bf16 autocast where the device runs it natively, else fp32), same optimizer family (AdamW
fused, weight decay 0.1, clip 1.0, warmup + cosine). Each contestant runs in a fresh process;
rounds are interleaved (onegpu, HF, HF compiled, plain, then again) and medians are reported.

- onegpu: `onegpu train` with the device's defaults, nothing tuned (memory measurement off,
  as it profiles one step).
- hf: `Trainer` on `GPT2LMHeadModel` (SDPA attention), `optim="adamw_torch_fused"`,
  `bf16=True`, no evaluation, no saving, logging every 10 steps; `hf-compile` adds
  `torch_compile=True`. The best of the two is "the best HF settings".
- plain: the same `GPT2LMHeadModel` in a hand-written loop (autocast, fused AdamW, clip).
- hf+tcmalloc: `hf` with the allocator onegpu preloads, to show how much of the gap it is
  (not counted as an HF setting).

Step time: median over steps after the warm-up (WARMUP); tokens/s = batch tokens / step time;
peak memory: the process's peak RSS (ru_maxrss), the same view for every contestant; loss: the
mean training loss of the last 10 steps.

Usage: python benchmarks/vs_hf_trainer.py [--steps 60] [--rounds 3] [--out benchmarks/results]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from onegpu.perf.allocator import find_tcmalloc

WARMUP = 10  # steps left out of the timing (compilation, allocator growth, first profiles)
SHAPES = dict(n_layer=6, n_head=4, d_model=256, seq_len=256, vocab_size=256)
BATCH, LR, WD, CLIP, WARMUP_STEPS = 16, 1e-3, 0.1, 1.0, 20


def _peak_rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _hf_model():
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(
        n_layer=SHAPES["n_layer"],
        n_head=SHAPES["n_head"],
        n_embd=SHAPES["d_model"],
        n_positions=SHAPES["seq_len"],
        vocab_size=SHAPES["vocab_size"],
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        attn_implementation="sdpa",
    )
    torch.manual_seed(1337)
    return GPT2LMHeadModel(cfg)


def _windows():
    """The token windows onegpu trains on (its own data path: same bytes, same split)."""
    from onegpu.config import load_config
    from onegpu.data.loader import PackedSequences
    from onegpu.data.tokens import prepare_tokens

    cfg = load_config("small")
    return PackedSequences(prepare_tokens(cfg.data, cfg.model.vocab_size).train, SHAPES["seq_len"])


def _precision() -> str:
    from onegpu.techniques.precision import bf16_native

    return "bf16" if bf16_native(torch.device("cpu")) else "fp32"


def _cosine(step: int, steps: int) -> float:
    if step < WARMUP_STEPS:
        return (step + 1) / WARMUP_STEPS
    p = (step - WARMUP_STEPS) / max(1, steps - WARMUP_STEPS)
    return 0.1 + 0.45 * (1 + math.cos(math.pi * p))


def run_plain(steps: int) -> dict:
    model = _hf_model()
    data = _windows()
    g = torch.Generator().manual_seed(1337)
    order = torch.randperm(len(data), generator=g)
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2 and "wte" not in n]
    rest = [p for n, p in model.named_parameters() if not (p.ndim >= 2 and "wte" not in n)]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": WD}, {"params": rest, "weight_decay": 0.0}],
        lr=LR,
        betas=(0.9, 0.95),
        fused=True,
    )
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: _cosine(s, steps))
    bf16 = _precision() == "bf16"
    times, losses = [], []
    for step in range(steps):
        t0 = time.perf_counter()
        idx = order[step * BATCH : (step + 1) * BATCH].tolist()
        x = torch.stack([data[i][0] for i in idx])
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            loss = model(input_ids=x, labels=x).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
        times.append(time.perf_counter() - t0)
    return _result(times, losses)


def run_hf(steps: int, compile_: bool) -> dict:
    from transformers import Trainer, TrainerCallback, TrainingArguments

    data = _windows()

    class Windows(torch.utils.data.Dataset):
        def __len__(self):
            return len(data)

        def __getitem__(self, i):
            x = data[i][0]
            return {"input_ids": x, "labels": x}

    times: list[float] = []
    losses: list[float] = []

    class Clock(TrainerCallback):
        def on_step_begin(self, args, state, control, **kw):
            self.t0 = time.perf_counter()

        def on_step_end(self, args, state, control, **kw):
            times.append(time.perf_counter() - self.t0)

        def on_log(self, args, state, control, logs=None, **kw):
            if logs and "loss" in logs:
                losses.append(logs["loss"])

    with tempfile.TemporaryDirectory() as out:
        args = TrainingArguments(
            output_dir=out,
            use_cpu=True,
            bf16=_precision() == "bf16",
            per_device_train_batch_size=BATCH,
            max_steps=steps,
            learning_rate=LR,
            weight_decay=WD,
            adam_beta2=0.95,
            max_grad_norm=CLIP,
            warmup_steps=WARMUP_STEPS,
            lr_scheduler_type="cosine",
            optim="adamw_torch_fused",
            torch_compile=compile_,
            logging_steps=10,
            save_strategy="no",
            eval_strategy="no",
            report_to="none",
            dataloader_num_workers=0,
            disable_tqdm=True,
            seed=1337,
        )
        Trainer(model=_hf_model(), args=args, train_dataset=Windows(), callbacks=[Clock()]).train()
    return _result(times, losses[-1:] * 10)


def run_onegpu(steps: int) -> dict:
    with tempfile.TemporaryDirectory() as out:
        cmd = [sys.executable, "-m", "onegpu", "train", "--out", out, "--out.overwrite", "true"]
        cmd += ["--train.max_steps", str(steps), "--train.log_every", "1"]
        cmd += ["--train.eval_every", "0", "--train.measure_memory", "false"]
        cmd += ["--out.progress", "false", "--out.save_checkpoint", "false"]
        subprocess.run(cmd, check=True, capture_output=True)
        rows = [json.loads(x) for x in (Path(out) / "metrics.jsonl").read_text().splitlines()]
        summary = json.loads((Path(out) / "summary.json").read_text())
    res = _result([r["step_time_s"] for r in rows], [r["loss"] for r in rows])
    res["peak_rss_bytes"] = summary["peak_mem_bytes"]
    return res


def _result(times: list[float], losses: list[float]) -> dict:
    steady = times[WARMUP:]
    step = statistics.median(steady)
    return {
        "step_time_s": step,
        "tokens_per_s": BATCH * SHAPES["seq_len"] / step,
        "first_steps_s": sum(times[:WARMUP]),
        "loss": statistics.mean(losses[-10:]),
        "peak_rss_bytes": _peak_rss(),
    }


CONTESTANTS = ("onegpu", "hf", "hf-compile", "plain", "hf+tcmalloc")


def worker(name: str, steps: int) -> dict:
    torch.set_num_threads(torch.get_num_threads())
    if name == "onegpu":
        return run_onegpu(steps)
    if name == "plain":
        return run_plain(steps)
    return run_hf(steps, compile_=name == "hf-compile")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--only", default=",".join(CONTESTANTS))
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        print(json.dumps(worker(args.worker, args.steps)))
        return
    names = args.only.split(",")
    runs: dict[str, list[dict]] = {n: [] for n in names}
    for r in range(args.rounds):
        for n in names:  # interleaved: a slow moment of the shared machine hits every contestant
            env = dict(os.environ)
            if n.endswith("+tcmalloc"):  # the allocator onegpu preloads, given to HF too
                env["LD_PRELOAD"] = find_tcmalloc() or ""
            worker_name = n.removesuffix("+tcmalloc")
            proc = subprocess.run(
                [sys.executable, __file__, "--worker", worker_name, "--steps", str(args.steps)],
                capture_output=True,
                text=True,
                env=env,
            )
            if proc.returncode != 0:
                sys.exit(f"{n} failed:\n{proc.stderr[-3000:]}")
            res = json.loads(proc.stdout.strip().splitlines()[-1])
            runs[n].append(res)
            print(f"round {r + 1} {n}: {res['tokens_per_s']:,.0f} tokens/s", flush=True)
    med = {n: {k: statistics.median(x[k] for x in rs) for k in rs[0]} for n, rs in runs.items()}
    hf_best = max(  # the best HF *settings*: an allocator preload is not one of them
        (n for n in med if n.startswith("hf") and "+" not in n),
        key=lambda n: med[n]["tokens_per_s"],
    )
    lines = [
        "# onegpu vs transformers.Trainer vs a plain PyTorch loop",
        "",
        f"Model: GPT-2 architecture {SHAPES}, batch {BATCH}; {args.steps} steps per run, "
        f"median step after {WARMUP} warm-up steps; {args.rounds} interleaved rounds, medians.  ",
        f"Machine: {platform.machine()}, {torch.get_num_threads()} threads, torch {torch.__version__}; "
        f"precision {_precision()}; {time.strftime('%Y-%m-%d')}.  ",
        f"Command: `python benchmarks/vs_hf_trainer.py --steps {args.steps} --rounds {args.rounds}`",
        "",
        f"| contestant | tokens/s | x {hf_best} | step time | peak RSS | loss (last 10 steps) "
        "| first 10 steps |",
        "|---|---|---|---|---|---|---|",
    ]
    for n, m in med.items():
        lines.append(
            f"| {n} | {m['tokens_per_s']:,.0f} | {m['tokens_per_s'] / med[hf_best]['tokens_per_s']:.2f} "
            f"| {m['step_time_s'] * 1e3:.0f} ms | {m['peak_rss_bytes'] / 2**20:,.0f} MiB "
            f"| {m['loss']:.3f} | {m['first_steps_s']:.1f} s |"
        )
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "vs-hf-trainer.md").write_text("\n".join(lines) + "\n")
    (out / "vs-hf-trainer.json").write_text(json.dumps({"runs": runs, "median": med}, indent=1))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
