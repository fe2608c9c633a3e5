"""`onegpu profile` and `onegpu bench` write the files scripts rely on."""

import json
import re

import pytest

from onegpu.cli import main


@pytest.mark.slow  # a profiled run (12 s): the fast suite stays under 5 minutes
def test_profile_writes_trace_memory_timeline_and_summary(tmp_path, capsys):
    out = tmp_path / "prof"
    assert main(["profile", "--preset", "tiny", "--train.device", "cpu", "--out", str(out)]) == 0
    trace = json.loads((out / "trace.json").read_text())
    names = {e.get("name") for e in trace["traceEvents"]}
    assert {"data", "forward", "backward", "optimizer"} <= names
    assert sum(str(n).startswith("ProfilerStep#") for n in names) == 3
    html = (out / "memory.html").read_text()
    assert "data:image/png;base64," in html and (out / "memory.png").stat().st_size > 1000
    summary = (out / "summary.txt").read_text()
    for phrase in ("phases", "forward", "idle gaps", "synchronisations", "top operations"):
        assert phrase in summary
    # the contract line for scripts, and where the gap above the floor goes
    line = re.search(r"^matmul floor: ([\d.]+) ms a step; measured ([\d.]+) ms = ([\d.]+)x the floor$",
                     summary, re.M)  # fmt: skip
    assert line, summary
    floor_ms, step_ms, ratio = map(float, line.groups())
    # printed to 2 decimals: a floor timed on busy cores can lie far above a tiny step
    rounding = 0.05 / floor_ms + 0.005 / max(ratio, 0.01)  # the floor to 0.1 ms, ratio to 0.01
    assert floor_ms > 0 and ratio == pytest.approx(step_ms / floor_ms, rel=0.05 + rounding)
    assert "of the gap" in summary or "no gap measured" in summary
    # and which products take the floor, with their rate: the first is the largest
    largest = re.findall(
        r"^ +([\d.]+) ms +\d+ x (?:mm|addmm|bmm) .* ([\d,]+) GFLOP/s$", summary, re.M
    )
    assert largest and float(largest[0][0]) == max(float(ms) for ms, _ in largest), summary


@pytest.mark.gpu
def test_on_a_gpu_profile_says_what_the_peak_held_and_which_lines_allocated_it(tmp_path, capsys):
    """memory_peak.json and the summary's lines: the recorded window's highest allocated total,
    its largest part allocated by a line of onegpu's code."""
    out = tmp_path / "prof"
    argv = ["profile", "--preset", "tiny", "--train.device", "cuda", "--out", str(out)]
    assert main(argv) == 0
    peak = json.loads((out / "memory_peak.json").read_text())
    assert peak["peak_bytes"] > peak["before_window_bytes"] > 0
    assert any(s["site"].startswith("onegpu/") for s in peak["by_site"])
    assert "allocated at the recorded window's peak" in (out / "summary.txt").read_text()
    assert (out / "memory_snapshot.pickle").stat().st_size > 0


@pytest.mark.slow
def test_bench_writes_table_json_and_plot_one_row_per_entry(tmp_path, capsys):
    grid = tmp_path / "grid.toml"
    grid.write_text(
        '[[row]]\nname = "fp32"\n\n[[row]]\nname = "remat"\n'
        '[row.overrides]\n"memory.checkpointing" = "block"\n'
    )
    out = tmp_path / "bench"
    # attention pinned: each row is a fresh process and `auto` times its kernel (plain keeps
    # fp32 scores), so rows that chose differently would not compare by checkpointing alone
    args = ["bench", "--preset", "tiny", "--train.device", "cpu", "--grid-file", str(grid),
            "--model.attention", "sdpa"]  # fmt: skip
    assert main([*args, "--steps", "5", "--out", str(out)]) == 0
    rows = json.loads((out / "bench.json").read_text())
    assert [r["name"] for r in rows] == ["fp32", "remat"]
    for r in rows:
        assert r["tokens_per_s"] > 0 and r["step_time_s"] > 0 and r["peak_mem_bytes"] > 0
        assert r["loss"] > 0 and "overrides" in r
    assert rows[1]["overrides"]["memory.checkpointing"] == "block"
    assert rows[1]["memory"]["activations"] < rows[0]["memory"]["activations"]
    table = (out / "bench.md").read_text()
    assert table.count("| fp32 |") == 1 and table.count("| remat |") == 1
    assert (out / "bench.png").read_bytes()[:4] == b"\x89PNG"


def test_bench_refuses_bad_grid_and_steps(tmp_path, capsys):
    assert main(["bench", "--preset", "tiny", "--grid", "hff", "--out", str(tmp_path)]) == 2
    assert "--grid" in capsys.readouterr().err
    assert main(["bench", "--preset", "tiny", "--steps", "2", "--out", str(tmp_path)]) == 2
    assert not (tmp_path / "bench.json").exists()


@pytest.mark.slow
def test_tune_finds_a_fitting_configuration_that_train_accepts(tmp_path, capsys):
    out = tmp_path / "tune"
    # the kernel pinned: each measured row is a fresh run that would time its own
    args = ["tune", "--preset", "tiny", "--train.device", "cpu", "--memory", "3500000",
            "--model.attention", "sdpa"]  # fmt: skip
    assert main([*args, "--time-budget", "1", "--steps", "5", "--out", str(out)]) == 0
    result = json.loads((out / "tune.json").read_text())
    assert result["fitting"] < result["planned"] <= result["candidates"]  # the planner pruned
    best = result["best"]
    assert best["planned_peak_bytes"] <= 3_500_000
    assert best["peak_mem_bytes"] <= 3_500_000 * 1.1  # measured, within the planner's error
    assert (out / "tune.png").read_bytes()[:4] == b"\x89PNG"
    run = tmp_path / "run"
    train_args = ["train", "--config", str(out / "best.toml"), "--out", str(run)]
    assert main([*train_args, "--train.max_steps", "2", "--out.progress", "false"]) == 0
    summary = json.loads((run / "summary.json").read_text())
    assert summary["steps"] == 2


@pytest.mark.slow
def test_tune_with_an_impossible_budget_says_what_it_would_need(tmp_path, capsys):
    args = ["tune", "--preset", "tiny", "--train.device", "cpu", "--memory", "1000"]
    assert main([*args, "--out", str(tmp_path / "t")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("onegpu: error: --memory: nothing fits 1,000 bytes") and "needs" in err
    assert not (tmp_path / "t").exists()


def test_grids_are_named_after_what_they_reproduce_and_old_names_still_work():
    from onegpu.tools.bench import GRIDS, grid_names

    assert set(GRIDS) == {"hf-guide", "hf-guide-bert", "lippe", "training-loop"}
    assert grid_names("seed000,seed003,hf,hf-bert") == [
        "lippe", "training-loop", "hf-guide", "hf-guide-bert"]  # fmt: skip
    assert grid_names("all") == list(GRIDS)
