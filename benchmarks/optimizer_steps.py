"""Each optimizer's step alone on a model's parameters: is any cheaper per step than fused AdamW?

Issue 30 asks where a step's non-matmul time goes; the what-ifs (benchmarks/step_cuts.py) put
B's clipping and optimizer step at ~23 ms of a ~370 ms step on an AMX Xeon. An optimizer with
smaller states moves fewer bytes, so it could be a way to cut that. This times each optimizer
onegpu offers (benchmarks/small_state_optimizers.py's rows, built by onegpu's own factory) on
the parameters of benchmarks/vs_peers.py's model A or B: rounds interleaved, fresh gradients
each time and the caches flushed before each step (in a training step the gradients come
from backward, mostly out of cache), plus onegpu's gradient norm and clipping, which every
optimizer's step pays on top.

    python benchmarks/optimizer_steps.py --model B [--rounds 15]

Writes benchmarks/results/optimizer-steps-<model>-<date>.md (a new file each run).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
from records import bf16_kind, write_result
from small_state_optimizers import ROWS
from vs_peers import MODELS

from onegpu.config import Config
from onegpu.models.gpt import GPT
from onegpu.optim.factory import build_optimizer
from onegpu.optim.state_bytes import optimizer_state_bytes
from onegpu.perf.allocator import active_allocator

WARM = 3  # rounds left out: first steps allocate states (torchao's compile their step)
FLUSH_BYTES = 256 * 2**20  # written before each timed step: more than this VM's caches hold
NORM = "gradient norm (torch's foreach 2-norm)"
CLIP = "clipping (the gradients times a factor, in place)"
READ = "a plain sum of each gradient (one read of them, for scale)"


def model_for(name: str) -> GPT:
    cfg = Config()
    for key, value in MODELS[name]["shape"].items():
        setattr(cfg.model, key, value)
    cfg.model.dropout = 0.0
    torch.manual_seed(0)
    return GPT(cfg.model)


def optimizer_for(model: GPT, over: dict[str, str]) -> torch.optim.Optimizer:
    cfg = Config()
    for key, value in over.items():
        field = key.removeprefix("optim.")
        setattr(cfg.optim, field, type(getattr(cfg.optim, field))(value))
    return build_optimizer(model, cfg.optim, torch.device("cpu"))


def gradient_steps(params: list[torch.Tensor]) -> dict[str, Callable[[], object]]:
    """What TrainStep._clip_and_step does before any optimizer's step, part by part (the same
    calls), and a plain read of the gradients to compare them with."""
    grads = lambda: [p.grad for p in params]  # noqa: E731 (fresh each timing)
    return {
        NORM: lambda: torch.nn.utils.get_total_norm(grads(), foreach=True),
        CLIP: lambda: torch.nn.utils.clip_grads_with_norm_(
            params, 1.0, torch.tensor(2.0), foreach=True
        ),
        READ: lambda: [g.sum() for g in grads()],
    }


def timed(step: Callable[[], object], params: list[torch.Tensor], flush: torch.Tensor) -> float:
    """One step's seconds, on fresh gradients, after the caches were flushed."""
    for p in params:
        p.grad = torch.randn_like(p).mul_(1e-3)
    flush.add_(1)
    start = time.perf_counter()
    step()
    return time.perf_counter() - start


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", default="B", choices=["A", "B"])
    ap.add_argument("--rounds", type=int, default=15)
    a = ap.parse_args()
    model = model_for(a.model)
    params = list(model.parameters())
    optimizers = {name: optimizer_for(model, over) for name, over in ROWS.items()}
    steps = gradient_steps(params) | {name: opt.step for name, opt in optimizers.items()}
    flush = torch.zeros(FLUSH_BYTES // 4)
    times: dict[str, list[float]] = {name: [] for name in steps}
    for _ in range(a.rounds):
        for name, step in steps.items():
            times[name].append(timed(step, params, flush))
    write_result(f"optimizer-steps-{a.model}", report(a, params, optimizers, times), show=True)


def report(
    a: argparse.Namespace,
    params: list[torch.Tensor],
    optimizers: dict[str, torch.optim.Optimizer],
    times: dict[str, list[float]],
) -> list[str]:
    n_params = sum(p.numel() for p in params)
    kept = {name: sorted(ts[WARM:]) for name, ts in times.items()}
    adamw = statistics.median(kept["adamw"])
    lines = [
        f"# Each optimizer's step alone, on model {a.model}'s parameters (CPU)",
        "",
        f"`python benchmarks/optimizer_steps.py --model {a.model} --rounds {a.rounds}`; "
        f"{a.model} = {MODELS[a.model]['shape']}, {n_params:,} fp32 parameters; bf16 kind: "
        f"{bf16_kind()}, {torch.get_num_threads()} threads, torch {torch.__version__}, allocator "
        f"{active_allocator()}; {time.strftime('%Y-%m-%d')}. Rounds interleaved, the first "
        f"{WARM} left out; fresh gradients and flushed caches before each step. The optimizers "
        "as onegpu builds them (fused AdamW where torch has it), lr and decay at onegpu's "
        "defaults. `x adamw`: the row's median over AdamW's. In a training step every optimizer "
        "is stepped after the norm and the clipping (the first two rows). GaLore's and "
        "APOLLO's projections are made in the first round (left out) and again every "
        "update_proj_gap steps (200), which these rounds do not reach.",
        "",
        "| step | median ms (quartiles) | mean ms | x adamw | state bytes | bytes/weight |",
        "|---|---|---|---|---|---|",
    ]
    for name, ts in kept.items():
        q1, med, q3 = statistics.quantiles(ts, n=4) if len(ts) > 1 else (ts[0],) * 3
        opt = optimizers.get(name)
        state = f"{optimizer_state_bytes(opt):,}" if opt is not None else "-"
        per = f"{optimizer_state_bytes(opt) / n_params:.2f}" if opt is not None else "-"
        lines.append(
            f"| {name} | {med * 1e3:.1f} ({q1 * 1e3:.1f}-{q3 * 1e3:.1f}) | "
            f"{statistics.fmean(ts) * 1e3:.1f} | {med / adamw:.2f} | {state} | {per} |"
        )
    return lines


if __name__ == "__main__":
    main()
