"""The markdown of benchmarks/gpu_suite.py's results: one table per section."""

from __future__ import annotations

from typing import Any

GIB = 2**30


def _gib(n: float | None) -> str:
    return "-" if n is None else f"{n / GIB:.2f}"


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1e3:.1f}"


def _not_run(r: dict[str, Any]) -> str | None:
    """A row that did not run or failed, in one cell: why (the budget's words, or the error's end)."""
    if "skipped" in r:
        return r["skipped"]
    if "failed" in r:  # one cell: a `|` in the error would split it
        return f"failed: {r['failed'][-200:]!r}".replace("|", "\\|")
    return None


def _tests(t: dict[str, Any]) -> list[str]:
    if "skipped" in t:
        return ["## CUDA-only tests", "", f"`{t['command']}`: not run, {t['skipped']}", ""]
    status = f"exit {t['rc']}" if t["rc"] is not None else "did not run to its end"
    lines = ["## CUDA-only tests", "", f"`{t['command']}`: {status}, {t['summary']}", ""]
    if t["rc"] != 0 and t["tail"]:  # what failed, to fix without another lease
        lines += ["```", *t["tail"], "```", ""]
    return lines


def _memory(rows: list[dict[str, Any]]) -> list[str]:
    lines = ["## Planned against measured step peak (GPT-2 124M, seq 1024, batch 8)", "",
             "| configuration | planned GiB | measured GiB | error | step ms | predicted ms |",
             "|---|---|---|---|---|---|"]  # fmt: skip
    for r in rows:
        if why := _not_run(r):
            lines.append(f"| {r['name']} | {why} | | | | |")
            continue
        lines.append(
            f"| {r['name']} | {_gib(r['planned_peak'])} | {_gib(r['measured_peak'])} | "
            f"{r['error']:+.1%} | {_ms(r['step_time_s'])} | {_ms(r['predicted_step_time_s'])} |"
        )
    return (
        lines
        + [
            "",
            "Measured: `torch.cuda.max_memory_allocated` of a 4-step `onegpu train`.",
            "",
        ]
        + _kernels_apart_lines([(r["name"], r) for r in rows])
    )


def _kernels_apart_lines(rows: list[tuple[str, dict[str, Any]]]) -> list[str]:
    """Rows whose plan followed other kernels than the run chose: their error is the
    choice's, not the planner's arithmetic."""
    lines = [
        f"- {name}: the plan followed {_kernels(r['kernels_apart']['plan'])}, the run chose "
        f"{_kernels(r['kernels_apart']['run'])}"
        for name, r in rows
        if "kernels_apart" in r
    ]
    return ["Plans that followed other kernels than their run:", "", *lines, ""] if lines else []


def _kernels(k: dict[str, Any]) -> str:
    kernel = f" ({k['loss_kernel']} kernels)" if k.get("loss_kernel") and k["loss_chunk"] else ""
    return f"attention {k['attention']}, loss chunk {k['loss_chunk'] or 'off'}{kernel}"


def _explain(rows: list[dict[str, Any]]) -> list[str]:
    """Each mis-planned row's peak, by the line that allocated its bytes."""
    lines = ["## What the mis-planned rows held at their peak", ""]
    for r in rows:
        head = (f"**{r['name']}** (plan {r['error']:+.1%}: {_gib(r['planned_peak'])} planned, "
                f"{_gib(r['measured_peak'])} GiB measured)")  # fmt: skip
        if why := _not_run(r):
            lines += [f"{head}: {why}", ""]
            continue
        lines += [f"{head}: {_gib(r['peak_bytes'])} GiB at the profiled run's peak", "",
                  "| GiB | allocated at | blocks |", "|---|---|---|"]  # fmt: skip
        lines += [
            f"| {_gib(x['bytes'])} | `{x['site']}` | {x['blocks'] or '-'} |"
            for x in r["by_site"][:8]
        ]
        lines.append("")
    if not rows:
        lines += ["No memory row was planned more than 5% off: nothing to explain.", ""]
    return lines


def _overlap(o: dict[str, Any]) -> list[str]:
    lines = ["## The optimizer on the host: overlap with backward", "",
             "| row | step ms | peak GiB |", "|---|---|---|"]  # fmt: skip
    for name, r in o["rows"].items():
        why = _not_run(r)
        cells = f"{why} | |" if why else f"{_ms(r['step_time_s'])} | {_gib(r['peak'])} |"
        lines.append(f"| {name} | {cells}")
    tr = o.get("trace")
    if tr is None:
        return lines + [""]
    if why := _not_run(tr):
        return lines + ["", f"Trace of one in-backward step: {why}", ""]
    more = "" if "link_out_s" not in tr else (
        f" The step took {_ms(tr.get('step_s'))} ms under the profiler, the compute stream "
        f"{_ms(tr['compute_s'])} ms from its first kernel to its last"
        f"{' (taken as the busiest stream: no launch linked to the step)' if tr.get('compute_stream_by') == 'most kernels' else ''}. The link "
        f"({tr['copies']} copies): gradients out {_ms(tr['link_out_s'])} ms "
        f"({_ms(tr['link_out_exposed_s'])} after that kernel), weights back "
        f"{_ms(tr['link_back_s'])} ms ({_ms(tr['link_back_exposed_s'])} after it).")  # fmt: skip
    if "land_s" in tr:
        more += (f" Gradients landed (copy waited for, added in): {tr['lands']}, "
                 f"{_ms(tr['land_s'])} ms; backward waited for room in the staging ring "
                 f"{tr['room_waits']} times, {_ms(tr['room_wait_s'])} ms.")  # fmt: skip
    return lines + ["", f"Trace of one in-backward step: {tr.get('host_steps')} host steps, "
                    f"{_ms(tr.get('host_step_s'))} ms of host stepping, {_ms(tr.get('exposed_s'))} "
                    f"ms of it after the compute stream's last kernel.{more}", ""]  # fmt: skip


def _speed(rows: list[dict[str, Any]]) -> list[str]:
    lines = ["## Speed against a nanoGPT-style compiled loop", "",
             "| model | onegpu tok/s (predicted) | compile | MFU | peak GiB (planned) | loop tok/s | "
             "loop MFU | loop peak GiB | onegpu / loop |", "|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for r in rows:
        if why := _not_run(r):
            half = r.get("onegpu")  # the loop failed or ran out of budget after onegpu's run
            done = f"{half['tokens_per_s']:,.0f} tok/s; " if half else ""
            lines.append(f"| {r['model']} | {done}{why} | | | | | | | |")
            continue
        o, lp = r["onegpu"], r["loop"]
        lines.append(f"| {r['model']} | {o['tokens_per_s']:,.0f}{_predicted(o)} | {o.get('compile', '?')} | "
                     f"{o['mfu'] or 0:.1%} | "
                     f"{_gib(o['peak'])} ({_gib(o['planned_peak'])}) | {lp['tokens_per_s']:,.0f} | "
                     f"{lp['mfu'] or 0:.1%} | {_gib(lp['peak'])} | {r['ratio']:.2f}x |")  # fmt: skip
    planned = [(r["model"], r["onegpu"]) for r in rows if r.get("onegpu")]
    return lines + [""] + _compile_decisions(rows) + _kernels_apart_lines(planned)


def _predicted(o: dict[str, Any]) -> str:
    """The plan's tokens/s beside the measured, and what bounds its step where the host does."""
    if not o.get("predicted_tokens_per_s"):
        return ""
    host = ", launches" if o.get("bound") == "dispatch" else ""
    return f" ({o['predicted_tokens_per_s']:,.0f}{host})"


def _compile_decisions(rows: list[dict[str, Any]]) -> list[str]:
    """Why `train.compile auto` chose what it did in each speed row: the trial's figures, or
    why it timed no compiled step at all."""
    lines = []
    for r in rows:
        trial = (r.get("onegpu") or {}).get("compile_auto")
        if not trial:
            continue
        if trial.get("skipped"):
            why = f"no compiled trial: {trial['skipped']}"
        else:
            why = (f"a micro-batch {_ms(trial['eager_step_s'])} ms eager, "
                   f"{_ms(trial['compiled_step_s'])} ms compiled ({trial['mode']}), "
                   f"{trial['compile_s']:.0f} s to compile")  # fmt: skip
        lines.append(f"- {r['model']}: compile {trial.get('chosen', '?')}: {why}")
    return ["`train.compile auto` in each row:", ""] + lines + [""] if lines else []


SECTIONS = {"tests": _tests, "memory": _memory, "explain": _explain, "overlap": _overlap,
            "speed": _speed}  # fmt: skip


def markdown(results: dict[str, Any]) -> str:
    """The result file: the environment, each finished section's table, what failed."""
    env = results["environment"]
    lines = [f"# GPU suite on {env['device']} ({env['date']})", "",
             f"Command: `{results['command']}`; torch {env['torch']}, CUDA {env['cuda']}, "
             f"host CPU {env['cpu']}. Written by benchmarks/gpu_suite.py.", ""]  # fmt: skip
    for name, section in SECTIONS.items():
        if name in results:  # explain's empty list says nothing needed explaining
            lines += section(results[name])
    failed = [f"- {k.removesuffix('_failed')} failed: `{v}`" for k, v in results.items()
              if k.endswith("_failed")]  # fmt: skip
    return "\n".join(lines + failed) + "\n"
