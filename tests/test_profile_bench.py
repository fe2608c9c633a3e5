"""`onegpu profile` and `onegpu bench` write the files scripts rely on."""

import json

from onegpu.cli import main


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


def test_bench_writes_table_json_and_plot_one_row_per_entry(tmp_path, capsys):
    grid = tmp_path / "grid.toml"
    grid.write_text(
        '[[row]]\nname = "fp32"\n\n[[row]]\nname = "remat"\n'
        '[row.overrides]\n"memory.checkpointing" = "block"\n'
    )
    out = tmp_path / "bench"
    args = ["bench", "--preset", "tiny", "--train.device", "cpu", "--grid-file", str(grid)]
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
