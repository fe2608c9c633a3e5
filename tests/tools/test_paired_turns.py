"""benchmarks/paired.py times contestants in turns: each turn keeps only steps that ran whole,
never the one a freeze cut in two, and ratios compare contestants cycle by cycle."""

import os
import sys
import textwrap
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))

from paired import Contestant, ratio, run_in_turns, spread, step_time  # noqa: E402

# A contestant whose every step sleeps `step_s` and logs how long it took, as a trainer does:
# like onegpu's meter, it starts the next step's clock before it writes the last step's line,
# and spends `lag_s` in between (a freeze there lands in the next step).
STEPPER = textwrap.dedent(
    """
    import json, sys, time
    path, step_s, lag_s = sys.argv[1], float(sys.argv[2]), float(sys.argv[3])
    with open(path, "a") as log:
        t0 = time.perf_counter()
        for _ in range(10_000):
            time.sleep(step_s)
            t1 = time.perf_counter()
            seconds, t0 = t1 - t0, t1
            time.sleep(lag_s)
            log.write(json.dumps({"step_time_s": seconds}) + "\\n")
            log.flush()
    """
)


def _contestant(tmp_path: Path, name: str, step_s: float, lag_s: float = 0.0) -> Contestant:
    script = tmp_path / "stepper.py"
    script.write_text(STEPPER)
    steps_file = tmp_path / f"{name}.jsonl"
    cmd = [sys.executable, str(script), str(steps_file), str(step_s), str(lag_s)]
    return Contestant(name, cmd, dict(os.environ), steps_file)


def test_turns_keep_whole_steps_only(tmp_path):
    # the slow one's turn (the rest of a cut step and 3 more of 0.4 s) freezes the quick one
    # far longer than its steps (0.21 s: most of it between restarting its clock and writing
    # its line, where a freeze lands in the step after the one it interrupted): a kept step
    # with a freeze in it would last over 0.8 s
    quick = _contestant(tmp_path, "quick", 0.01, lag_s=0.2)
    slow = _contestant(tmp_path, "slow", 0.4)
    run_in_turns([quick, slow], warm=2, cycles=3, turn_steps=2, log=lambda _: None)
    # at least the turn's steps each turn (a quick one may finish more before it is frozen)
    assert len(quick.turns) == len(slow.turns) == 3
    assert all(len(t) >= 2 for t in quick.turns + slow.turns)
    assert max(t for turn in quick.turns for t in turn) < 0.8
    # the dropped steps are in the log, and one of each turn's did include a freeze
    assert sum(t > 0.8 for t in quick.steps()) >= 3
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
    assert spread(a, b) == (2.0, 2.0)
    assert step_time(a) == 1.5
