"""`onegpu plan --largest`: the largest model of a family that trains in full on a GPU (and the
host memory beside it), with what it takes and how fast it is predicted to run.

The family is the configured model grown and shrunk as decoder families grow (plan/shapes.py:
width and depth together, head size and kv heads kept), about x1.7 parameters a rung. Each
rung is planned as configured and, where that does not fit, with the fix list (plan/fixes.py:
the fastest changes first, the host tiers included); fitting is monotone in size, so a binary
search over the ladder plans a handful of rungs. Every rung reported as fitting was confirmed
by following the full model.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from onegpu.config import Config, ConfigError, ModelConfig
from onegpu.perf.devices import GPUS, known_gpu
from onegpu.perf.host_memory import machine_ram
from onegpu.plan.fixes import fixes_for, planned
from onegpu.plan.shapes import Shape, ladder, shape_of, with_shape
from onegpu.plan.targets import CUDA_OVERHEAD_BYTES, gpu_caps, one_budget


def find_largest(
    cfg: Config,
    gpu: str | None,
    memory_bytes: int | None,
    host_memory: int | None = None,
    log: Callable[[str], None] = print,
) -> dict[str, Any]:
    """The largest rung of `cfg`'s family that fits, the smallest that does not, and every
    rung planned on the way."""
    if gpu is None and memory_bytes is None:
        raise ConfigError("--largest", "needs a device to fit: --gpu NAME or --memory BYTES")
    one_budget(gpu, memory_bytes)
    known_gpu(gpu)
    target, caps = ("cuda", gpu_caps(gpu)) if gpu else ("cpu", None)
    budget = GPUS[gpu].memory_bytes - CUDA_OVERHEAD_BYTES if gpu else int(memory_bytes or 0)
    host = host_memory or machine_ram()
    sizes = ladder(shape_of(cfg))
    tokens = cfg.train.batch_size * cfg.train_seq_len
    tried: dict[int, dict[str, Any]] = {}

    def fits(i: int) -> bool:
        if i not in tried:
            tried[i] = _rung(cfg, sizes[i], target, caps, gpu, budget, host, tokens)
            r = tried[i]
            how = (
                f"fits with {_flags(r['overrides']) or 'the configuration as it is'}"
                if r["fits"]
                else "does not fit"
            )
            log(f"  {r['params'] / 1e9:6.2f}B ({sizes[i].label()}): {how}")
        return tried[i]["fits"]

    lo, hi = -1, len(sizes)  # sizes[lo] fits (or none), sizes[hi] does not (or none)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return {
        "gpu": gpu,
        "budget_bytes": budget,
        "host_memory_bytes": host,
        "largest": tried.get(lo),
        "next": tried.get(hi),
        "tried": [tried[i] for i in sorted(tried)],
        "top_of_ladder": hi == len(sizes),
    }


def _rung(cfg, shape: Shape, target, caps, gpu, budget: int, host: int, tokens: int) -> dict:
    """One size: as configured, else with the fix list; what it needs and how fast it runs."""
    sized = with_shape(cfg, shape)
    p = planned(sized, target, caps, gpu, fast=True)
    out = {
        "shape": shape.__dict__,
        "label": shape.label(),
        "params": p.n_params,
        "model_flags": _model_flags(sized.model),
        "overrides": {},
        "peak": p.peak,
        "host": p.host,
        "step_s": p.step_s,
        "fits": False,
    }
    if p.peak <= budget and p.host <= host:
        full = planned(sized, target, caps, gpu, fast=False)
        if full.peak <= budget and full.host <= host:
            return out | {
                "fits": True,
                "peak": full.peak,
                "host": full.host,
                "step_s": full.step_s,
                "tokens_per_s": tokens / full.step_s if full.step_s else None,
            }
    found = fixes_for(sized, budget, target, caps, base_peak=p.peak, gpu=gpu, host_budget=host)
    best = next((f for f in found if "best_overrides" in f), None)
    if best is None:  # how close the fix list came: its last step
        last = found[-1] if found else {"peak_with_previous": p.peak, "host_with_previous": p.host}
        return out | {
            "closest": {"peak": last["peak_with_previous"], "host": last["host_with_previous"]}
        }
    step_s = best["step_s_with_previous"]
    return out | {
        "fits": True,
        "overrides": best["best_overrides"],
        "peak": best["peak_with_previous"],
        "host": best["host_with_previous"],
        "step_s": step_s,
        "tokens_per_s": tokens / step_s if step_s else None,
    }


def _model_flags(m: ModelConfig) -> dict[str, str]:
    """The [model] overrides that train this size: a reshaped folder (its config.json alone,
    under the cache) for model.hf, the fields of onegpu's GPT otherwise."""
    if m.hf:
        return {"model.hf": m.hf}
    return {
        "model.n_layer": str(m.n_layer),
        "model.d_model": str(m.d_model),
        "model.n_head": str(m.n_head),
        "model.mlp_ratio": str(m.mlp_ratio),
    }


def _flags(overrides: dict[str, str]) -> str:
    return " ".join(f"--{k} {v}" for k, v in overrides.items())


def format_largest(r: dict[str, Any]) -> str:
    GiB = 2**30
    where = r["gpu"] or f"a budget of {r['budget_bytes'] / GiB:,.1f} GiB"
    lines = [
        f"onegpu plan --largest: the largest of this model's family that trains in full on "
        f"{where}, with {r['host_memory_bytes'] / GiB:,.1f} GiB of host memory (a "
        "prediction: fake tensors, the CUDA context kept aside)"
    ]
    best = r["largest"]
    if best is None:
        lines.append("  none: even the smallest size planned does not fit")
    else:
        speed = f", ~{best['tokens_per_s']:,.0f} tokens/s" if best.get("tokens_per_s") else ""
        lines += [
            f"  largest: {best['params'] / 1e9:.2f}B parameters ({best['label']})",
            f"    device {best['peak'] / GiB:,.2f} GiB, host {best['host'] / GiB:,.1f} GiB{speed}",
            f"    with: {_flags(best['overrides']) or 'the configuration as it is'}",
            f"    this size: {_flags(best['model_flags'])}",
        ]
    nxt = r["next"]
    if nxt is not None:
        close = nxt.get("closest")
        why = (
            f": the fix list reaches {close['peak'] / GiB:,.1f} GiB on the device and "
            f"{close['host'] / GiB:,.1f} GiB on the host"
            if close
            else ""
        )
        lines.append(
            f"  next size up, {nxt['params'] / 1e9:.2f}B ({nxt['label']}): does not fit{why}"
        )
    elif r["top_of_ladder"]:
        lines.append("  every size planned fits: the ladder ends here")
    return "\n".join(lines)
