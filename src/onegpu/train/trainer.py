"""The training loop: build, then steps; metrics are read from the device once per log step."""

from __future__ import annotations

import math
import statistics
import time
from typing import Any

import torch
from torch.profiler import record_function
from tqdm.auto import tqdm

from onegpu.build import Built, build
from onegpu.config import Config, to_dict
from onegpu.data.loader import DevicePrefetcher, count_targets, make_eval_batches, make_train_loader
from onegpu.memory.breakdown import profile_step_memory, with_exact_optimizer_bytes
from onegpu.memory.measure import peak_bytes, peak_kind, reset_peak
from onegpu.memory.saved import SavedTensorCounter
from onegpu.optim import lr_at, set_lr
from onegpu.optim.state_bytes import optimizer_state_bytes
from onegpu.perf.devices import peak_flops
from onegpu.train.run_folder import RunFolder, environment, resolve_out_dir
from onegpu.train.step import forward_backward, optimizer_step


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@torch.no_grad()
def evaluate(built: Built, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> float:
    """Mean next-token loss over fixed validation batches (summed, then divided by tokens)."""
    model, device = built.model, built.device
    model.eval()
    total = torch.zeros((), device=device, dtype=torch.float64)
    n = 0
    for x, y in batches:
        with built.policy.autocast(device):
            total += built.loss_fn(model, x.to(device), y.to(device)).double()
        n += count_targets(y)
    model.train()
    return total.item() / max(n, 1)


def measure_step(built: Built, one_step, n_micro: int) -> dict[str, Any]:
    """Run one training step under the memory profiler and the saved-tensor counter."""
    result = []
    counter = SavedTensorCounter(built.model)

    def step():
        with counter:
            result.append(one_step())

    memory = profile_step_memory(step, built.device)
    with_exact_optimizer_bytes(memory, optimizer_state_bytes(built.optimizer))
    # micro-batches have equal shapes, so each saves the same bytes
    memory["saved_activations_per_micro_batch"] = counter.bytes // n_micro
    memory["_result"] = result[0]
    return memory


def _num_workers(cfg: Config, device: torch.device) -> int:
    if cfg.data.num_workers >= 0:
        return cfg.data.num_workers
    return 2 if device.type == "cuda" else 0  # on CPU workers compete with compute for cores


def training_batches(cfg: Config, built: Built) -> DevicePrefetcher:
    """(inputs, targets, target count) batches, copied to the device one step ahead."""
    loader = make_train_loader(
        built.data.train,
        seq_len=cfg.train_seq_len,
        batch_size=cfg.train.batch_size,
        seed=cfg.train.seed,
        num_workers=_num_workers(cfg, built.device),
        pin_memory=built.device.type == "cuda",
    )
    return DevicePrefetcher(((x, y, count_targets(y)) for x, y in loader), built.device)


def train(cfg: Config) -> dict[str, Any]:
    """Run training as configured; returns the summary also written to summary.json."""
    out_dir = resolve_out_dir(cfg.out)  # fail before any work if the folder holds a run
    built = build(cfg)
    model, device, opt, policy = built.model, built.device, built.optimizer, built.policy
    T, tcfg = cfg.train_seq_len, cfg.train
    run = RunFolder(out_dir, cfg)

    eval_batches = (
        make_eval_batches(
            built.data.val, seq_len=T, batch_size=tcfg.micro_batch_size, n_batches=tcfg.eval_batches
        )
        if tcfg.eval_every
        else []
    )
    peak = peak_flops(device, policy.compute_dtype, policy.name)
    scaler = policy.grad_scaler(device)
    batches = training_batches(cfg, built)
    n_micro = cfg.grad_accum_steps

    print(
        f"onegpu: {built.n_params:,} parameters | {device} | {policy.name} | "
        f"batch {tcfg.batch_size}x{T} tokens in {n_micro} micro-batch(es) | data {built.data.description} | "
        f"run folder {out_dir}"
    )
    torch.manual_seed(tcfg.seed)  # dropout stream
    model.train()
    reset_peak(device)
    memory: dict[str, Any] = {}
    intervals: list[tuple[float, float | None]] = []  # (tokens/s, mfu) per log interval
    loss_acc = torch.zeros((), device=device)
    steps_in_interval, tokens_in_interval, skipped, tokens_total, steps_done = 0, 0, 0, 0, 0
    last_loss = val_loss = float("nan")
    bar = tqdm(total=tcfg.max_steps, disable=not cfg.out.progress, dynamic_ncols=True, unit="step")
    t_start = t_last = time.perf_counter()
    interrupted = False
    first_step_s = float("nan")
    try:
        for step in range(tcfg.max_steps):
            lr = lr_at(step, cfg.optim, tcfg.max_steps)
            set_lr(opt, lr)
            with record_function("data"):
                x, y, n_tokens = next(batches)
            scale_before = scaler.get_scale() if policy.loss_scaling else 0.0

            def one_step(x=x, y=y, n_tokens=n_tokens):
                loss = forward_backward(
                    model, built.loss_fn, policy, scaler, x, y, n_micro=n_micro, n_tokens=n_tokens
                )
                return loss, optimizer_step(model, opt, scaler, cfg.optim.grad_clip)

            if step == min(1, tcfg.max_steps - 1) and tcfg.measure_memory:
                # the second step: optimizer states exist, as in every later step
                memory = measure_step(built, one_step, n_micro)
                loss, grad_norm = memory.pop("_result")
            else:
                loss, grad_norm = one_step()
            if step == 0:
                _sync(device)
                first_step_s = time.perf_counter() - t_start  # includes any compilation
            if policy.loss_scaling and scaler.get_scale() < scale_before:
                skipped += 1  # the scaler found inf/nan gradients and skipped this step
            loss_acc += loss
            steps_in_interval += 1
            tokens_in_interval += x.numel()
            tokens_total += x.numel()
            steps_done = step + 1
            bar.update(1)

            last = step + 1 == tcfg.max_steps
            if (step + 1) % tcfg.log_every == 0 or last:
                _sync(device)
                now = time.perf_counter()
                dt = now - t_last
                last_loss = loss_acc.item() / steps_in_interval
                tok_s = tokens_in_interval / dt
                mfu = tok_s * built.flops_per_token / peak.flops if peak else None
                row = {
                    "step": step + 1,
                    "loss": last_loss,
                    "lr": lr,
                    "grad_norm": float(grad_norm),
                    "tokens_per_s": tok_s,
                    "mfu": mfu,
                    "step_time_s": dt / steps_in_interval,
                    "peak_mem_bytes": peak_bytes(device),
                }
                if policy.loss_scaling:
                    row |= {"loss_scale": scaler.get_scale(), "skipped_steps": skipped}
                run.log(row)
                intervals.append((tok_s, mfu))
                bar.set_postfix(
                    loss=f"{last_loss:.3f}",
                    tok_s=f"{tok_s:,.0f}",
                    mfu=f"{mfu:.1%}" if mfu is not None else "n/a",
                    mem=f"{row['peak_mem_bytes'] / 2**20:,.0f}MiB",
                )
                loss_acc.zero_()
                steps_in_interval = tokens_in_interval = 0
                t_last = time.perf_counter()
            if tcfg.eval_every and ((step + 1) % tcfg.eval_every == 0 or last):
                val_loss = evaluate(built, eval_batches)
                run.log(
                    {"step": step + 1, "val_loss": val_loss, "val_ppl": math.exp(min(val_loss, 50))}
                )
                bar.write(
                    f"step {step + 1}: val_loss {val_loss:.4f} (ppl {math.exp(min(val_loss, 50)):.2f})"
                )
                t_last = time.perf_counter()  # evaluation time is not training time
    except KeyboardInterrupt:
        interrupted = True
    finally:
        bar.close()
    train_time = time.perf_counter() - t_start

    # The first interval holds warm-up (allocator, kernel selection): leave it out of the median.
    steady = intervals[1:] if len(intervals) > 1 else intervals
    median_tok_s = statistics.median(t for t, _ in steady) if steady else None
    steady_step_s = tcfg.batch_size * T / median_tok_s if median_tok_s else None
    summary: dict[str, Any] = {
        "params": built.n_params,
        "tokens": tokens_total,
        "tokens_per_s": median_tok_s,
        "step_time_s": steady_step_s,
        "first_step_s": first_step_s,
        # the first step's excess over a steady step: compilation, warm-up, allocator growth
        "compile_time_s": (
            max(0.0, first_step_s - steady_step_s)
            if steady_step_s and cfg.train.compile != "none"
            else None
        ),
        "mfu": statistics.median(m for _, m in steady) if steady and peak else None,
        "peak_mem_bytes": peak_bytes(device),
        "peak_mem_kind": peak_kind(device),
        "memory": memory or None,
        "loss": last_loss,
        "val_loss": val_loss if tcfg.eval_every else None,
        "steps": steps_done,
        "interrupted": interrupted,
        "skipped_steps": skipped,
        "train_time_s": train_time,
        "flops_per_token": built.flops_per_token,
        "peak_flops": peak.flops if peak else None,
        "peak_flops_source": peak.source if peak else None,
        "precision": policy.name,
        "device": str(device),
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        **environment(),
        "config": to_dict(cfg),
    }
    if cfg.out.save_checkpoint:
        torch.save(
            {
                "model": model.state_dict(),
                "optimizer": opt.state_dict(),
                "step": steps_done,
                "config": to_dict(cfg),
            },
            run.path / "checkpoints" / "final.pt",
        )
    run.write_summary(summary)
    run.close()
    return summary
