"""`onegpu plan`'s report as the terminal shows it: memory at the peak, the analytic figures
beside it, the predicted speed (and what offloading adds), and whether it fits."""

from __future__ import annotations

from typing import Any

from onegpu.memory.breakdown import GROUPS
from onegpu.perf.devices import GPUS, GiB
from onegpu.plan.data_share import data_lines
from onegpu.plan.targets import CUDA_OVERHEAD_BYTES, HOST_SECONDS_PER_OP


def _by_block(by_block: dict[str, int]) -> str:
    """Blocks of equal size shown once ('blocks.0-47: 2,272.4 each')."""
    mib = 2**20
    blocks = {k: v for k, v in by_block.items() if k.startswith("blocks.")}
    rest = ", ".join(f"{k} {v / mib:,.1f}" for k, v in by_block.items() if k not in blocks)
    if blocks and len(set(blocks.values())) == 1:
        size = next(iter(blocks.values()))
        return f"blocks.0-{len(blocks) - 1} {size / mib:,.1f} each, {rest}"
    return ", ".join(f"{k} {v / mib:,.1f}" for k, v in by_block.items())


def format_report(r: dict[str, Any], gpu: str | None) -> str:
    """The report as the terminal shows it."""
    lines = _memory_lines(r) + [""] + _analytic_lines(r, gpu)
    if "bytes_per_step" in r.get("dist", {}):
        lines += [""] + _mesh_lines(r["dist"], gpu)
    if "capacity_bytes" in r:
        lines += [""] + _capacity_lines(r, gpu)
    return "\n".join(lines)


def _unkept_lines(files: list[str]) -> list[str]:
    """Where the plan follows the last run's choices from timings it did not keep."""
    if not files:
        return []
    return [
        f"  follows the last run's timings in {', '.join(files)}, not kept (taken on busy "
        "CPUs): the next run times them again and may choose otherwise"
    ]


def _loss_chunk(c: dict[str, Any]) -> str:
    """The chunk, and its kernels where they are inductor's (their memory is not ATen's)."""
    if not c["loss_chunk"]:
        return "off"
    compiled = " (kernels compiled)" if c.get("loss_kernel") == "compiled" else ""
    return f"{c['loss_chunk']}{compiled}"


def _memory_lines(r: dict[str, Any]) -> list[str]:
    mib, n, mem, c = 2**20, r["params"], r["memory"], r["config"]
    lines = _budget_lines(r.get("checkpointing_budget"))
    lines += [
        f"onegpu plan (a prediction: one training step followed on fake tensors, "
        f"{r['plan_seconds']:.1f} s)",
        f"  {n:,} parameters, {c['precision']}, batch {c['batch']} x {c['seq_len']} in "
        f"micro-batches of {c['micro_batch']}, checkpointing {c['checkpointing']}, "
        f"{c['optimizer']}, loss chunk {_loss_chunk(c)}, attention {c.get('attention', '?')}",
        *_unkept_lines(c.get("follows_unkept_timings", [])),
        "",
        "memory at the step's peak                  MiB    bytes/param",
    ]
    if "ranks" in r.get("dist", {}):
        d = r["dist"]
        shape = " x ".join(f"{k} {v}" for k, v in d["layout"].items() if v > 1)
        lines[0] += f"; per process of {d['world_size']} on the mesh {shape}"
        lines.insert(2, f"  rank {d['largest_rank']}'s (the largest; every stage's below)")
    elif "dist" in r:
        d = r["dist"]
        lines[0] += f"; per process of {d['world_size']} under {d['strategy']}"
        lines.insert(
            2,
            f"  rank 0's share (the largest); reshard_after_forward "
            f"{str(d['reshard_after_forward']).lower()}, cpu_offload "
            f"{str(d['cpu_offload']).lower()}",
        )
    groups = [*GROUPS, "gathered"] if "gathered" in mem else GROUPS
    for g in groups:
        per = f"{mem[g] / n:8.2f}" if g in ("params", "grads", "optimizer") else ""
        label = "gathered for compute (FSDP all-gather)" if g == "gathered" else g
        lines.append(f"  {label:<38} {mem[g] / mib:9,.1f}   {per}")
    if mem.get("host"):
        lines.append(f"  {'in host memory (offloaded)':<38} {mem['host'] / mib:9,.1f}")
    if mem.get("disk"):
        lines.append(f"  {'on disk (memory.offload_dir)':<38} {mem['disk'] / mib:9,.1f}")
    return lines + [
        f"  {'peak (predicted)':<38} {mem['peak'] / mib:9,.1f}   {mem['peak'] / n:8.2f}",
        f"  the peak comes in {r['peak_at']}",
        "",
        f"saved activations per micro-batch: {r['saved_activations_per_micro_batch'] / mib:,.1f} MiB",
        "  by kind:  " + ", ".join(f"{k} {v / mib:,.1f}" for k, v in r["saved_by_kind"].items()),
        "  by block: " + _by_block(r["saved_by_block"]),
    ]


def _analytic_lines(r: dict[str, Any], gpu: str | None) -> list[str]:
    mib, n, mem = 2**20, r["params"], r["memory"]
    lines = [
        "beside the analytic figures:",
        f"  HF's single-GPU guide: mixed-precision AdamW needs 18 bytes/parameter (fp32 weights 4, 16-bit copy "
        f"2, fp32 grads 4, states 8); planned here: "
        f"{(2 * mem['params'] + mem['optimizer']) / n:.2f} with every gradient alive (weights, "
        "same-sized gradients, states; the 16-bit weight copies of autocast live only while a "
        "step's micro-batches run and are counted under activations)",
        f"  Korthikanti et al.: s*b*h*(34 + 5*a*s/h) = "
        f"{r['korthikanti_bytes_per_layer'] / mib:,.1f} MiB per layer (16-bit, full attention "
        "matrix stored); fused attention keeps no s x s matrix and fp32 autocast ops keep 4-byte "
        "tensors, hence the difference with the per-block figures above",
    ]
    if "predicted_tokens_per_s" in r:
        lines.append(
            f"  speed on {gpu or 'this CPU'}: {r['predicted_tokens_per_s']:,.0f} tokens/s, "
            f"{r['predicted_step_time_s'] * 1e3:,.0f} ms/step (prediction: counted FLOPs at "
            f"{r['efficiency_assumed']:.0%} of the {'datasheet' if gpu else 'measured'} peak"
            + (
                f", x{r['recompute_factor']:.2f} for recomputation"
                if r.get("recompute_factor", 1) > 1
                else ""
            )
            + ")"
        )
        if r.get("bound") == "dispatch":
            lines.append(
                f"  the host bounds that step: {r['dispatched_ops']:,} ops launched eagerly at "
                f"{HOST_SECONDS_PER_OP * 1e6:.0f} us each take {r['predicted_dispatch_s'] * 1e3:,.1f} ms, "
                f"the GPU's work {r['predicted_compute_s'] * 1e3:,.1f} ms (fewer, larger steps, "
                "or CUDA graphs, would use it)"
            )
    lines += data_lines(r)
    if "offload" in r:
        o = r["offload"]
        states = (
            f"; the optimizer states' trips {o['states_link_s'] * 1e3:,.0f} ms of it, beside "
            "backward when stepped in it, else after it"
            if "states_link_s" in o
            else ""
        )
        link = (
            f"{o['link_bytes'] / GiB:,.2f} GiB over the host link ({o['link_s'] * 1e3:,.0f} ms "
            f"at {o['link_rate'] / 1e9:,.1f} GB/s, beside compute{states})"
            if "link_s" in o
            else "no link here (one memory)"
        )
        host_step = (
            f", then the CPU's optimizer step {o['host_step_s'] * 1e3:,.0f} ms "
            f"({o['host_step_source']})"
            if "host_step_source" in o
            else ""
        )
        lines.append(
            f"  offloaded: compute {r['predicted_compute_s'] * 1e3:,.0f} ms, {link}{host_step}"
        )
    return lines


def _mesh_lines(d: dict[str, Any], gpu: str | None) -> list[str]:
    """Each stage's peak (a mesh), what each mesh dimension sends, and the predicted step."""
    mib = 2**20
    lines = []
    if "ranks" in d:
        lines.append("per pipeline stage (a rank of each; the others of a stage hold the same):")
    for row in d.get("ranks", []):
        m = row["memory"]
        lines.append(
            f"  stage {row['stage']} (rank {row['rank']}): peak {m['peak'] / mib:,.1f} MiB "
            f"(weights {m['params'] / mib:,.1f}, grads {m['grads'] / mib:,.1f}, optimizer "
            f"{m['optimizer'] / mib:,.1f}, activations {m['activations'] / mib:,.1f})"
        )
    lines.append(
        f"sent per process per step ({d['micro_batches']} micro-batches, ring collectives):"
    )
    seconds = d.get("seconds_per_step_sending", {})
    for dim, n in d["bytes_per_step"].items():
        at = f", {seconds[dim] * 1e3:,.1f} ms over {d['interconnect']}" if dim in seconds else ""
        lines.append(f"  {dim:<13} {n / mib:12,.1f} MiB{at}")
    if "predicted_step_time_s" in d:
        lines.append(
            f"step on {gpu or 'this CPU'}: {d['predicted_step_time_s'] * 1e3:,.0f} ms, "
            f"{d['predicted_tokens_per_s']:,.0f} tokens/s (prediction: compute "
            f"{d['compute_s'] * 1e3:,.0f} ms at {d['efficiency_assumed']:.0%} of peak, "
            f"pipeline bubble {d['bubble']:.0%}, links at {d['link_efficiency_assumed']:.0%} of "
            "their datasheet rate; FSDP's gathers overlap compute, the other sends wait)"
        )
    return lines


def _budget_lines(b: dict[str, Any] | None) -> list[str]:
    """What `budget:BYTES` decided, above the plan of what it decided."""
    if not b:
        return []
    uniform = ", ".join(f"{p} {v / 2**20:,.1f}" for p, v in b["uniform_peaks"].items())
    return [
        f"checkpointing by budget ({b['budget'] / 2**20:,.1f} MiB): {b['checkpointing']}, "
        f"planned peak {b['planned_peak'] / 2**20:,.1f} MiB, "
        f"{b['recompute_factor'] - 1:.1%} of a step recomputed",
        f"  each policy on every block, planned peak MiB: {uniform}",
        "",
    ]


def _ms(seconds: float | None) -> str:
    return f", {seconds * 1e3:,.0f} ms" if seconds is not None else ""


def _fit_lines(r: dict[str, Any], gpu: str | None) -> list[str]:
    """Whether the step fits the device (a GPU, capped by --memory, or the budget) and the
    host, with the host's bytes by kind."""
    cap = r["capacity_bytes"]
    capped = gpu and cap < GPUS[gpu].memory_bytes  # --memory with --gpu: a tensor budget
    name = f"{gpu} capped at {(cap - CUDA_OVERHEAD_BYTES) / GiB:,.1f} GiB of tensors"
    lines = [
        f"{(name if capped else gpu) or 'the budget'}: {cap / GiB:,.1f} GiB -> "
        + ("fits" if r["fits"] else "DOES NOT FIT")
        + f", headroom {r['headroom_bytes'] / GiB:+,.2f} GiB"
        + (" (0.5 GiB kept for the CUDA context)" if gpu else ""),
    ]
    if r["memory"].get("host"):
        host, cap = r["memory"]["host"], r["host_memory_bytes"]
        lines.append(
            f"  host memory: {host / GiB:,.1f} GiB of {cap / GiB:,.1f} GiB -> "
            + ("fits" if host <= cap else "DOES NOT FIT: raise --host-memory or offload less")
        )
        if kinds := r.get("host_by_kind"):
            lines.append(
                "    by kind: " + ", ".join(f"{k} {v / GiB:,.1f} GiB" for k, v in kinds.items())
            )
    return lines


def _capacity_lines(r: dict[str, Any], gpu: str | None) -> list[str]:
    lines = _fit_lines(r, gpu)
    if r.get("fixes"):
        lines.append(
            "  fixes, fastest first (planned alone, then with the ones above; device "
            "GiB, host GiB, predicted ms/step):"
        )
    for f in r.get("fixes", []):
        if f.get("instead"):
            lines.append("  or instead, alone (predicted faster than the list above):")
        lines.append(
            f"  + {f['change']:<40} alone {f['peak_alone'] / GiB:6.2f}"
            f"{' fits' if f['fits_alone'] else '     '} | together "
            f"{f['peak_with_previous'] / GiB:6.2f}, host {f['host_with_previous'] / GiB:5.1f}"
            f"{_ms(f['step_s_with_previous'])}{'  FITS' if f['fits_with_previous'] else ''}"
            + ("  (dropped at the end: the rest fit without it)" if f.get("dropped") else "")
        )
    best = next((f for f in r.get("fixes", []) if "best_overrides" in f), None)
    if best:
        flags = " ".join(f"--{k} {v}" for k, v in best["best_overrides"].items())
        lines.append(f"  -> fits with: {flags} (--best-toml PATH writes the whole configuration)")
    if "gpus_needed" in r:
        lines += _gpus_needed_lines(r["gpus_needed"], gpu)
    if "mesh_fixes" in r:
        lines += _mesh_fix_lines(r["mesh_fixes"])
    short = [
        f
        for f in r.get("fixes", [])
        if f["peak_with_previous"] + (CUDA_OVERHEAD_BYTES if gpu else 0) <= r["capacity_bytes"]
        and f["host_with_previous"] > r["host_memory_bytes"]
    ]
    if short and not any(f["fits_with_previous"] for f in r["fixes"]):
        lines.append(
            f"  the device fits with {short[0]['host_with_previous'] / GiB:,.1f} GiB in host memory "
            f"(after '{short[0]['change']}'), more than the {r['host_memory_bytes'] / GiB:,.1f} "
            "GiB planned for: --host-memory BYTES plans for a larger host"
        )
    elif r.get("fixes") and not any(f["fits_with_previous"] for f in r["fixes"]):
        lines.append(
            "  nothing in the list makes it fit: a smaller model, shorter sequences "
            "or a larger GPU (or FSDP across several) are left"
        )
    return lines


def _mesh_fix_lines(m: dict[str, Any]) -> list[str]:
    """The layouts of N processes planned, fastest predicted first, and the one that fits."""
    lines = [
        f"  layouts of {m['world_size']} processes (TP, PP, HSDP, FSDP, DDP x checkpointing x "
        f"micro-batch), fastest predicted step first, planned until one fits ({m['candidates']} "
        f"candidates, {m['skipped_by_arithmetic']} too large by arithmetic):"
    ]
    for row in m["rows"]:
        lines.append(
            f"  + {row['label']:<48} largest rank {row['peak_bytes'] / GiB:6.2f} GiB"
            f"{_ms(row['step_s'])}{'  FITS' if row['fits'] else ''}"
        )
    best = m["best"]
    if best:
        flags = " ".join(f"--{k} {v}" for k, v in best["overrides"].items())
        lines.append(f"  -> fits with: {flags} (--best-toml PATH writes the whole configuration)")
    else:
        lines.append(f"  -> no layout of {m['world_size']} processes fits: more GPUs are needed")
    return lines


def _gpus_needed_lines(g: dict[str, Any], gpu: str | None) -> list[str]:
    """How many GPUs of this kind FSDP needs, as the plan's last lines."""
    table = ", ".join(
        f"{row['world_size']}: {row['peak'] / GiB:,.1f} GiB{' fits' if row['fits'] else ''}"
        for row in g["rows"]
    )
    return [
        f"  FSDP over N x {gpu}, rank 0's planned peak: {table}",
        f"  -> needs {g['fewest']} x {gpu}"
        if g["fewest"]
        else f"  -> does not fit on the GPU counts the global batch splits into "
        f"(up to {g['rows'][-1]['world_size']}); a larger global batch allows more",
    ]
