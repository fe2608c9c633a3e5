"""The end-to-end faults of benchmarks/fault_test.py, in small: two runs started into one folder,
a disk that fills during a save (a small tmpfs, where this process may mount one), text
appended to the data before a resume. Each scenario is a real `onegpu` process."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "fault_test.py"


def _scenario(name: str, tmp_path) -> dict:
    out = tmp_path / "report.json"
    proc = subprocess.run([sys.executable, str(SCRIPT), "--only", name, "--kills", "2",
                           "--json", str(out)], capture_output=True, text=True)  # fmt: skip
    assert out.exists(), proc.stderr[-3000:]
    report = json.loads(out.read_text())
    assert proc.returncode == 0, report
    return report


@pytest.mark.slow
def test_two_runs_into_one_folder_one_trains_and_one_is_refused_naming_the_pid(tmp_path):
    r = _scenario("concurrent", tmp_path)["concurrent"]
    assert r["pairs"] == 3 and not r["otherwise"]
    assert r["one_trained_one_refused_naming_the_pid"] >= 1


@pytest.mark.slow
def test_a_full_disk_is_one_line_and_the_resumed_run_is_the_uninterrupted_one(tmp_path):
    r = _scenario("disk-full", tmp_path)["disk_full"]
    if "skipped" in r:
        pytest.skip(r["skipped"])
    assert r["exit_code_when_full"] == 1 and r["one_line"], r
    assert "No space left on device" in r["last_line"]
    assert r["resumed_equals_uninterrupted"]


@pytest.mark.slow
def test_data_changed_before_a_resume_is_refused_unless_meant(tmp_path):
    r = _scenario("data-changed", tmp_path)["data_changed"]
    assert r == {"first_ok": True, "refused_exit": 2, "refusal_names_data_source": True,
                 "override_exit": 0}  # fmt: skip


@pytest.mark.slow
def test_a_bench_killed_at_random_moments_leaves_whole_result_files(tmp_path):
    r = _scenario("bench", tmp_path)["bench"]
    assert r["kills"] + r["finished_before_the_kill"] == 2
