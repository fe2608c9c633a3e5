"""benchmarks/paired.py times contestants in turns: each turn keeps only steps that ran whole,
never the one a freeze cut in two, and ratios compare contestants cycle by cycle."""

import os
import sys
import textwrap
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))

from paired import Contestant, ratio, run_in_turns, step_time  # noqa: E402

# A contestant whose every step sleeps `step_s` and logs how long it took, as a trainer does.
STEPPER = textwrap.dedent(
    """
    import json, sys, time
    path, step_s = sys.argv[1], float(sys.argv[2])
    with open(path, "a") as log:
        for _ in range(10_000):
            t0 = time.perf_counter()
            time.sleep(step_s)
            log.write(json.dumps({"step_time_s": time.perf_counter() - t0}) + "\\n")
            log.flush()
    """
)


def _contestant(tmp_path: Path, name: str, step_s: float) -> Contestant:
    script = tmp_path / "stepper.py"
    script.write_text(STEPPER)
    steps_file = tmp_path / f"{name}.jsonl"
    cmd = [sys.executable, str(script), str(steps_file), str(step_s)]
    return Contestant(name, cmd, dict(os.environ), steps_file)


def test_turns_keep_whole_steps_only(tmp_path):
    # the slow one's turn (2 steps of 0.4 s) freezes the quick one far longer than its steps:
    # a quick step cut by a freeze would last > 0.8 s
    quick = _contestant(tmp_path, "quick", 0.01)
    slow = _contestant(tmp_path, "slow", 0.4)
    run_in_turns([quick, slow], warm=2, cycles=3, turn_steps=2, log=lambda _: None)
    # at least the turn's steps each turn (a quick one may finish more before it is frozen)
    assert len(quick.turns) == len(slow.turns) == 3
    assert all(len(t) >= 2 for t in quick.turns + slow.turns)
    assert max(t for turn in quick.turns for t in turn) < 0.4
    # the cut steps are in the log (each turn's first), and they did include a freeze
    assert max(quick.steps()) > 0.8
    assert quick.peak_rss_bytes > 0 and slow.peak_rss_bytes > 0
    assert quick.proc.poll() is not None and slow.proc.poll() is not None


def test_a_contestant_that_dies_is_named(tmp_path):
    script = tmp_path / "dies.py"
    script.write_text("import sys; sys.exit('out of memory')")
    cmd = [sys.executable, str(script)]
    dead = Contestant("dead", cmd, dict(os.environ), tmp_path / "none.jsonl")
    with pytest.raises(RuntimeError, match="(?s)dead ended early:.*out of memory"):
        run_in_turns([dead], warm=1, cycles=1, turn_steps=1, log=lambda _: None)


def test_ratio_is_the_median_of_ratios_per_cycle():
    a = Contestant("a", [], {}, Path("-"), turns=[[1.0, 1.0], [2.0, 2.0], [1.0, 3.0]])
    b = Contestant("b", [], {}, Path("-"), turns=[[2.0, 2.0], [4.0, 4.0], [4.0, 4.0]])
    # per cycle b/a: 2, 2, 2 (cycle 3: median 4 over median 2): a machine twice as slow in
    # cycle 2 moves neither
    assert ratio(a, b) == 2.0
    assert ratio(b, a) == 0.5
    assert step_time(a) == 1.5
