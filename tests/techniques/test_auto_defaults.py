"""`memory.loss_chunk auto` and `train.compile auto`: deterministic given the cached timings,
timed only where the choice can matter, and the chunked loss they choose computes the plain
loss and gradients."""

import json

import pytest
import torch

from onegpu.backends.torch.build import build
from onegpu.cache import cache_root
from onegpu.config import ConfigError, load_config
from onegpu.perf import logits
from onegpu.perf.devices import device_key
from onegpu.perf.logits import untimed_chunk
from onegpu.techniques import chunked_loss, compile, compile_auto
from onegpu.techniques.compile_auto import CompileTrial, best_of, time_compile, trials_of
from onegpu.techniques.loss import token_loss_sum

CPU = torch.device("cpu")


def _cfg(**over):
    base = {"train.device": "cpu", "train.precision": "fp32", "model.dropout": "0.0",
            "out.progress": "false"}  # fmt: skip
    return load_config("tiny", overrides=base | {k: str(v) for k, v in over.items()})


def _store(name: str, key: str, value) -> None:
    path = cache_root() / name
    cache = json.loads(path.read_text()) if path.exists() else {}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(cache | {key: value}))


def _never(*_a, **_k):
    raise AssertionError("timed although the cache holds the answer")


def choose_compile(key: str, micro_steps: int, measures) -> tuple[str, CompileTrial]:
    """What `decide` does with the modes' trials: cached under `key|mode`, the best of them."""
    return best_of(trials_of(key, measures), micro_steps)


# ---------------------------------------------------------------------------- config


@pytest.mark.parametrize(("value", "want"), [("auto", "auto"), ("0", 0), ("2048", 2048)])
def test_loss_chunk_takes_auto_or_an_integer(value, want):
    assert load_config("tiny", overrides={"memory.loss_chunk": value}).memory.loss_chunk == want


@pytest.mark.parametrize("value", ["big", "-1", "1.5"])
def test_bad_loss_chunk_is_refused(value):
    with pytest.raises(ConfigError, match="memory.loss_chunk"):
        load_config("tiny", overrides={"memory.loss_chunk": value})


def test_defaults_are_auto():
    cfg = load_config("small")
    assert cfg.memory.loss_chunk == "auto" and cfg.train.compile == "auto"


# ---------------------------------------------------------------------------- loss chunk


def test_small_logits_are_never_chunked_nor_timed(monkeypatch):
    """The default model (byte vocabulary) has logits far below the floor: off, no timing."""
    monkeypatch.setattr(chunked_loss, "measure_loss_chunk", _never)
    over = {"train.device": "cpu", "model.attention": "sdpa", "train.max_steps": "20"}
    built = build(load_config("small", overrides=over), CPU, with_data=False)
    assert built.cfg.memory.loss_chunk == 0


def test_share_of_the_logits_decides():
    big_vocab = load_config("seed-ref").model  # 50,257 tokens over 4 narrow blocks
    wide = load_config("small", overrides={"model.vocab_size": "512"}).model
    assert chunked_loss.logits_share(big_vocab, 4096, 4) > 0.8
    assert chunked_loss.logits_share(wide, 4096, 4) < chunked_loss.MIN_LOGITS_SHARE


@pytest.mark.parametrize("chunk", [0, 2048])
def test_auto_chunk_is_the_cached_choice(monkeypatch, chunk):
    """Same cache, same answer, and nothing timed: the choice is deterministic given it."""
    m = load_config("seed-ref").model
    vocab = chunked_loss.padded_vocab(m)
    key = f"{device_key(CPU)}|{torch.float32}|tokens=4096|d={m.d_model}|vocab={vocab}"
    seconds = {"0": 1.0, "1024": 1.2, "2048": 1.04 if chunk else 1.1}
    _store("loss_chunk.json", key, {"chunk": chunk, "seconds": seconds})
    monkeypatch.setattr(chunked_loss, "measure_loss_chunk", _never)
    for _ in range(2):
        assert chunked_loss.resolve_loss_chunk("auto", m, 4096, torch.float32, CPU) == chunk


def test_auto_chunk_respects_unchunkable_models(monkeypatch):
    monkeypatch.setattr(chunked_loss, "measure_loss_chunk", _never)
    m = load_config("seed-ref").model
    got = chunked_loss.resolve_loss_chunk("auto", m, 4096, torch.float32, CPU, chunkable=False)
    assert got == 0


def test_a_plan_never_times_the_loss(monkeypatch):
    monkeypatch.setattr(chunked_loss, "measure_loss_chunk", _never)
    m = load_config("seed-ref", overrides={"model.d_model": "192"}).model  # no cache entry
    got = chunked_loss.resolve_loss_chunk("auto", m, 8192, torch.float32, CPU, timed=False)
    assert got == chunked_loss.UNTIMED_CHUNK


def test_an_untimed_plan_takes_a_chunk_a_run_could_choose():
    """A chunk of the whole micro-batch is no contestant of the timing: no run takes it."""
    assert [untimed_chunk(t) for t in (16384, 8192, 4096, 2048, 1024)] == [
        4096,
        4096,
        2048,
        1024,
        0,
    ]


def test_measured_choice_is_a_timed_size():
    got = chunked_loss.measure_loss_chunk(2048, 32, 4096, torch.float32, CPU)
    assert got["chunk"] in (0, *chunked_loss.CHUNK_SIZES)
    assert set(got["seconds"]) == {"0", "1024"}  # chunk sizes below the micro-batch's tokens


@pytest.mark.parametrize(
    "seconds,want",
    [
        ({"0": 1.00, "1024": 1.04, "2048": 1.01, "4096": 1.00}, 1024),  # leanest within 5%
        ({"0": 1.00, "1024": 1.20, "2048": 1.06, "4096": 1.05}, 4096),
        ({"0": 1.00, "1024": 1.20, "2048": 1.10}, 0),  # no chunk within 5%: plain
        ({"0": 1.30, "1024": 1.10, "2048": 1.00}, 2048),  # faster than plain, 1024 not within
    ],
)
def test_auto_takes_the_leanest_chunk_within_the_margin_of_the_fastest(seconds, want):
    assert chunked_loss.leanest_within_margin(seconds) == want


def test_default_chunked_path_equals_the_plain_loss(monkeypatch):
    """The default config, where `auto` chunks, computes the plain loss and gradients."""
    monkeypatch.setattr(logits, "MIN_LOGITS_BYTES", 0)
    timed = {"chunk": 96, "seconds": {"0": 1.0, "96": 1.0}}
    monkeypatch.setattr(chunked_loss, "measure_loss_chunk", lambda *a: timed)
    over = {"model.vocab_size": "4096"}
    auto, plain = build(_cfg(**over), CPU, with_data=False), None
    assert auto.cfg.memory.loss_chunk == 96  # the chunked loss really runs
    plain = build(_cfg(**over, **{"memory.loss_chunk": "0"}), CPU, with_data=False)
    x = torch.randint(0, 4096, (4, 65))

    def loss_and_grads(b):
        loss = b.step.forward_backward(x[:, :-1], x[:, 1:], x[:, 1:].numel())
        return loss, {n: p.grad.clone() for n, p in b.model.named_parameters()}

    (la, ga), (lp, gp) = loss_and_grads(auto), loss_and_grads(plain)
    torch.testing.assert_close(la, lp, rtol=1e-6, atol=0)
    for name, g in ga.items():  # equal up to fp32 summation order
        # + 1e-8: the key bias's gradient is zero by math (rounding noise on both sides)
        assert (g - gp[name]).norm() < 1e-5 * gp[name].norm() + 1e-8, name


# ---------------------------------------------------------------------------- compile


@pytest.mark.parametrize(
    ("trial", "steps", "pays"),
    [
        (CompileTrial(1.0, 0.8, 30.0), 100, False),  # saves 20 s, costs 30
        (CompileTrial(1.0, 0.8, 30.0), 200, True),  # saves 40 s
        (CompileTrial(1.0, 1.2, 0.0), 10_000, False),  # compiled is slower
    ],
)
def test_compile_pays_over_the_run(trial, steps, pays):
    assert trial.pays(steps) is pays


def test_compile_choice_is_the_cached_trial_that_saves_the_most():
    _store(
        "compile.json",
        "k|default",
        {"eager_step_s": 1.0, "compiled_step_s": 0.5, "compile_s": 60.0},
    )
    _store(
        "compile.json",
        "k|regional",
        {"eager_step_s": 1.0, "compiled_step_s": 0.6, "compile_s": 10.0},
    )
    modes = {"default": _never, "regional": _never}
    mode, trial = choose_compile("k", 200, modes)  # saves 40 s vs regional's 70 s
    assert (mode, trial.cached, trial.mode) == ("regional", True, "regional")
    assert [t.mode for t in trial.others] == ["default"]
    assert choose_compile("k", 1000, modes)[0] == "default"  # 440 s vs 390 s
    assert choose_compile("k", 20, modes)[0] == "none"  # neither repays its compile
    assert choose_compile("k", 200, {"default": _never})[0] == "default"  # one mode asked


def test_modes_timed_at_different_moments_are_weighed_on_one_eager_step():
    """default was timed while the machine ran at half speed (eager 2 s), regional at full
    speed (eager 1 s). Both run 1.67x faster compiled: on one eager step of 1 s, default saves
    40 s and costs 10 to compile, regional saves 40 and costs 1. Read as absolute seconds,
    default's slow moment would have made it look like a 80 s saving."""
    _store(
        "compile.json",
        "moments|default",
        {"eager_step_s": 2.0, "compiled_step_s": 1.2, "compile_s": 10.0},
    )
    _store(
        "compile.json",
        "moments|regional",
        {"eager_step_s": 1.0, "compiled_step_s": 0.6, "compile_s": 1.0},
    )
    mode, trial = choose_compile("moments", 100, {"default": _never, "regional": _never})
    assert mode == "regional"
    assert trial.saves(100, 1.0) == pytest.approx(39.0)
    assert trial.others[0].saves(100, 1.0) == pytest.approx(30.0)
    assert trial.others[0].saves(100) == pytest.approx(70.0)  # its own eager: the slow one
    # what the first line shows for default: its compiled step at its speedup over 1 s eager
    assert trial.others[0].compiled_at(1.0) == pytest.approx(0.6)


def test_eager_and_compiled_are_timed_side_by_side(monkeypatch):
    """A machine slow for one pair (eager 2 s, compiled 0.8 s: a 2.5x the others do not show):
    the speedup is the median of the pairs' ratios and the eager step the fastest, so neither
    is read off the slow moment."""
    ran = []
    pairs = [(2.0, 0.8), (1.0, 0.6), (1.0, 0.5), (1.1, 0.6), (1.0, 0.55)]
    times = iter([9.0, 30.0, *(t for pair in pairs for t in pair)])

    def timed(fn, *a):
        ran.append(fn.__name__)
        return next(times)

    def eager(*a):
        raise AssertionError

    def compiled(*a):
        raise AssertionError

    monkeypatch.setattr(compile_auto, "_timed", timed)
    monkeypatch.setattr(compile_auto, "PAIRS", len(pairs))
    moves = []
    candidate = compile.Candidate(
        lambda: moves.append("enter") or compiled, lambda: moves.append("leave")
    )
    trial = time_compile(None, eager, candidate, None, None, CPU)
    assert ran == ["eager", "compiled"] + ["eager", "compiled"] * len(pairs)
    assert moves == ["enter"] + ["leave", "enter"] * len(pairs) + ["leave"]
    speedup = 1.1 / 0.6  # the median of 2.5, 1.67, 2, 1.83 and 1.82
    assert trial.eager_s == 1.0 and trial.compiled_s == pytest.approx(1.0 / speedup)
    assert trial.compile_s == 29.5  # the first compiled run's excess over the fastest


def test_regional_entered_again_compiles_nothing():
    """The regional candidate keeps the blocks' compiled calls when left and puts the same ones
    back when entered again (a trial switches between eager and compiled; the run takes the
    trial's compile)."""
    built = build(_cfg(), CPU, with_data=False)
    candidate = compile.auto_candidates(built.model, built.loss_fn, lambda f: f, built.device)[
        "regional"
    ]
    candidate.enter()
    calls = [b._compiled_call_impl for b in built.model.blocks]
    assert all(c is not None for c in calls)
    candidate.leave()
    assert all(b._compiled_call_impl is None for b in built.model.blocks)
    candidate.enter()
    assert all(b._compiled_call_impl is c for b, c in zip(built.model.blocks, calls))
    candidate.leave()


def test_compile_auto_is_not_timed_for_short_or_distributed_runs(monkeypatch):
    monkeypatch.setattr(compile_auto, "time_compile", _never)
    assert build(_cfg(), CPU, with_data=False).cfg.train.compile == "none"  # 20 steps
    long = _cfg(**{"train.max_steps": 1000})
    assert compile_auto.auto_candidate(long, CPU, distributed=True) == "none"
    assert compile_auto.auto_candidate(long, CPU, distributed=False) == "default"


@pytest.mark.parametrize(("compiled_s", "want"), [(0.5, "default"), (2.0, "none")])
def test_build_follows_the_trial(monkeypatch, tmp_path, compiled_s, want):
    """A long run times eager against compiled once; the build and its config.toml follow."""
    monkeypatch.setenv("ONEGPU_CACHE", str(tmp_path))  # its stub trials stay its own
    trial = CompileTrial(1.0, compiled_s, 1.0)
    monkeypatch.setattr(compile_auto, "time_compile", lambda *a: trial)
    monkeypatch.setattr(compile_auto, "_eager_s", lambda *a: 1.0)  # a step slow enough to time
    # a key per case, and none a real trial of the session could have made (0.02, the
    # default, was one: a tiny run of 100+ steps elsewhere had cached its own timing under it)
    over = {"train.max_steps": "500", "model.init_std": 0.01 + compiled_s / 1000}
    built = build(_cfg(**over), CPU, with_data=False)
    assert built.cfg.train.compile == want
    assert (built.compile_trial.eager_s, built.compile_trial.compiled_s) == (1.0, compiled_s)
    assert (built.loss_fn is token_loss_sum) == (want == "none")  # compiled: a wrapper
    assert all(b._compiled_call_impl is None for b in built.model.blocks)  # regional left


def test_a_complete_cache_decides_without_timing_anything(monkeypatch, tmp_path):
    """Every mode's trial cached: nothing is timed, eager included (the choice is the cache's
    and the run's length alone)."""
    monkeypatch.setenv("ONEGPU_CACHE", str(tmp_path))  # its made-up trials stay here
    cfg = _cfg(**{"train.max_steps": "500", "model.init_std": "0.017"})
    from onegpu.backends.torch.resolve import resolve

    key = (
        f"{compile_auto.device_key(CPU)}|{compile_auto.step_fingerprint(resolve(cfg, CPU).config)}"
    )
    _store(
        "compile.json",
        f"{key}|default",
        {"eager_step_s": 1.0, "compiled_step_s": 0.9, "compile_s": 1.0},
    )
    _store(
        "compile.json",
        f"{key}|regional",
        {"eager_step_s": 1.0, "compiled_step_s": 0.5, "compile_s": 1.0},
    )
    monkeypatch.setattr(compile_auto, "_eager_s", _never)
    monkeypatch.setattr(compile_auto, "time_compile", _never)
    built = build(cfg, CPU, with_data=False)
    assert built.cfg.train.compile == "regional" and built.compile_trial.cached


def test_auto_picks_regional_where_it_saves_more_and_applies_it(monkeypatch, tmp_path):
    """Each AUTO_MODES candidate is timed on the real model and left; the chosen one is then
    applied: regional compiles every block in place and keeps the eager loss function."""
    monkeypatch.setenv("ONEGPU_CACHE", str(tmp_path))  # no max-autotune trial seen here
    seen = []

    def timing(model, eager, candidate, *a):
        assert all(b._compiled_call_impl is None for b in model.blocks)  # eager timed as eager
        candidate.enter()
        regional = all(b._compiled_call_impl is not None for b in model.blocks)
        candidate.leave()
        seen.append(regional)
        return CompileTrial(1.0, 0.5 if regional else 0.9, 1.0)

    monkeypatch.setattr(compile_auto, "time_compile", timing)
    monkeypatch.setattr(compile_auto, "_eager_s", lambda *a: 1.0)
    built = build(
        _cfg(**{"train.max_steps": "500", "model.init_std": "0.013"}), CPU, with_data=False
    )
    assert seen == [False, True]  # default first, then regional
    assert built.cfg.train.compile == "regional" and built.compile_trial.mode == "regional"
    assert all(b._compiled_call_impl is not None for b in built.model.blocks)
    assert built.loss_fn is token_loss_sum
    assert [t.mode for t in built.compile_trial.others] == ["default"]
    from onegpu.backends.torch.report import describe_auto

    line = describe_auto(built)
    n = 500 * built.cfg.grad_accum_steps
    assert f"compile regional over {n} micro-batches (a micro-batch: eager 1,000 ms, " in line
    assert "regional 500 ms (+1 s to compile), default 900 ms (+1 s to compile))" in line


AUTOTUNE_WINS = {
    "default": CompileTrial(1.0, 0.9, 10.0),
    "regional": CompileTrial(1.0, 0.5, 5.0),
    "max-autotune": CompileTrial(1.0, 0.4, 90.0),
}
"""Trials where max-autotune runs fastest and compiles slowest (90 s)."""


def _trials_in_turn(
    monkeypatch, by_mode: dict[str, CompileTrial]
) -> tuple[list[str], dict[str, object]]:
    """time_compile stubbed: each candidate is entered and left, and gets the trial of the mode
    its entering compiled with (`compile.apply_compile` watched), from `by_mode`. Returns the
    modes timed, in order, and what apply_compile made for each."""
    timed: list[str] = []
    made: dict[str, object] = {}
    apply = compile.apply_compile

    def watched(model, loss_fn, mode, device):
        made[mode] = apply(model, loss_fn, mode, device)
        timed.extend([mode] if mode != "none" else [])  # 'none': the build's eager loss
        return made[mode]

    def timing(model, eager, candidate, *a):
        candidate.enter()
        candidate.leave()
        return by_mode[timed[-1]]

    monkeypatch.setattr(compile, "apply_compile", watched)
    monkeypatch.setattr(compile_auto, "time_compile", timing)
    monkeypatch.setattr(compile_auto, "_eager_s", lambda *a: 1.0)
    return timed, made


def test_a_long_run_times_max_autotune_too_and_takes_it_where_it_saves_the_most(
    monkeypatch, tmp_path
):
    """max-autotune's trial costs minutes, so only a run that could repay its least compile
    time (60 s on a CPU) at its assumed best gain over the best other mode (1.1x) times it: 250
    micro-batches of regional's 500 ms could save 11 s, 5,000 could save 227 s. Timed, it is
    weighed with the others and applied: the whole graph compiled with inductor's autotuning,
    its table of choices kept out of the run's output."""
    monkeypatch.setenv("ONEGPU_CACHE", str(tmp_path))
    trials = AUTOTUNE_WINS
    timed, made = _trials_in_turn(monkeypatch, trials)
    over = {"train.max_steps": "125", "model.init_std": "0.019"}  # 250 micro-batches
    assert build(_cfg(**over), CPU, with_data=False).cfg.train.compile == "regional"
    assert timed == ["default", "regional"]
    timed.clear()
    built = build(_cfg(**over | {"train.max_steps": "2500"}), CPU, with_data=False)
    assert timed == ["max-autotune"]  # the other two read from the cache: the same step
    assert built.cfg.train.compile == "max-autotune" and built.compile_trial.mode == "max-autotune"
    assert [t.mode for t in built.compile_trial.others] == ["default", "regional"]
    assert built.loss_fn is made["max-autotune"]  # its trial's compile, taken by the run
    assert all(b._compiled_call_impl is None for b in built.model.blocks)  # regional left
    from onegpu.backends.torch.report import describe_auto

    assert "max-autotune 400 ms (+90 s to compile), default 900 ms" in describe_auto(built)
    assert compile.autotune_options()["autotune_num_choices_displayed"] == 0
    monkeypatch.setenv("TORCHINDUCTOR_AUTOTUNE_NUM_CHOICES_DISPLAYED", "5")  # asked for: shown
    assert "autotune_num_choices_displayed" not in compile.autotune_options()


def test_a_cached_max_autotune_trial_is_weighed_whatever_the_runs_length(monkeypatch, tmp_path):
    """Once timed (cached), max-autotune costs nothing to weigh: a short run reads it too, and
    keeps the mode that saves the most over its own length, here regional (max-autotune's 90 s
    of compile is not repaid by 250 micro-batches)."""
    monkeypatch.setenv("ONEGPU_CACHE", str(tmp_path))
    trials = AUTOTUNE_WINS
    timed, _ = _trials_in_turn(monkeypatch, trials)
    over = {"train.max_steps": "2500", "model.init_std": "0.021"}
    assert build(_cfg(**over), CPU, with_data=False).cfg.train.compile == "max-autotune"
    assert timed == ["default", "regional", "max-autotune"]
    timed.clear()
    monkeypatch.setattr(compile_auto, "time_compile", _never)
    monkeypatch.setattr(compile_auto, "_eager_s", _never)
    short = build(_cfg(**over | {"train.max_steps": "125"}), CPU, with_data=False)
    assert short.cfg.train.compile == "regional"
    assert sorted(t.mode for t in short.compile_trial.others) == ["default", "max-autotune"]
    assert timed == ["regional"]  # the run's own mode applied; nothing timed


def test_the_autotune_bound_learns_from_this_machines_own_trials(monkeypatch, tmp_path):
    """Before any max-autotune trial: the assumed 1.1x gain and 60 s compile (CPU). After one
    that ran 1.5x faster than the best other mode of its step (regional, 2x eager; max-autotune
    3x) and compiled in 40 s, those are the bounds; a trial of another device is not read. Where
    it only lost, its gain is below 1: no later step of this machine pays for its trial."""
    monkeypatch.setenv("ONEGPU_CACHE", str(tmp_path))
    saves, costs = compile_auto.autotune_bound(CPU, 0.5, 1000)
    assert (saves, costs) == (pytest.approx(0.5 * (1 - 1 / 1.1) * 1000), 60.0)
    here = f"{compile_auto.device_key(CPU)}|step"
    _store("compile.json", f"{here}|regional",
           {"eager_step_s": 1.0, "compiled_step_s": 0.5, "compile_s": 5.0})  # fmt: skip
    _store("compile.json", f"{here}|max-autotune",
           {"eager_step_s": 0.9, "compiled_step_s": 0.3, "compile_s": 40.0})  # fmt: skip
    _store("compile.json", "another-gpu|step|max-autotune",
           {"eager_step_s": 1.0, "compiled_step_s": 0.1, "compile_s": 1.0})  # fmt: skip
    saves, costs = compile_auto.autotune_bound(CPU, 0.5, 1000)
    assert (saves, costs) == (pytest.approx(0.5 * (1 - 1 / 1.5) * 1000), 40.0)
    _store("compile.json", f"{here}|max-autotune",
           {"eager_step_s": 1.0, "compiled_step_s": 0.6, "compile_s": 40.0})  # fmt: skip
    saves, _ = compile_auto.autotune_bound(CPU, 0.5, 1000)  # it only lost (1.67x against 2x):
    assert saves < 0  # no other step of this machine times it again


def test_a_failing_max_autotune_trial_is_left_out_with_a_warning(monkeypatch, tmp_path):
    """max-autotune is an extra the run does not need: where its compile fails (inductor's
    templates), the run takes the best other mode and says why in one line, the model's
    gradients left clear. The failure is cached: a later run of the step does not try again."""
    monkeypatch.setenv("ONEGPU_CACHE", str(tmp_path))
    trials = {"default": CompileTrial(1.0, 0.9, 10.0), "regional": CompileTrial(1.0, 0.5, 5.0)}
    timed, _ = _trials_in_turn(monkeypatch, trials)
    stub = compile_auto.time_compile

    def failing(model, eager, candidate, *a):
        if len(timed) == 2:
            first = next(iter(model.parameters()))
            first.grad = torch.ones_like(first)  # a backward cut short
            raise torch._dynamo.exc.BackendCompilerFailed(lambda *a: None, RuntimeError("no"), None)
        return stub(model, eager, candidate, *a)

    monkeypatch.setattr(compile_auto, "time_compile", failing)
    over = {"train.max_steps": "2500", "model.init_std": "0.023"}
    with pytest.warns(UserWarning, match="max-autotune failed to compile in its trial"):
        built = build(_cfg(**over), CPU, with_data=False)
    assert built.cfg.train.compile == "regional"
    assert all(p.grad is None for p in built.model.parameters())
    stored = json.loads((cache_root() / "compile.json").read_text())
    assert [v for k, v in stored.items() if k.endswith("|max-autotune")] == [
        {"failed": "BackendCompilerFailed: backend='<lambda>' raised:"}
    ]
    monkeypatch.setattr(compile_auto, "time_compile", _never)
    assert build(_cfg(**over), CPU, with_data=False).cfg.train.compile == "regional"


def test_a_run_that_cannot_repay_a_compile_never_times_it(monkeypatch, tmp_path):
    """200 micro-batches of 300 ms could save at most 200 x 0.3 x (1 - 1/1.15) = 7.8 s on a
    CPU, against the 15 s a compile takes at least: compiled is not timed, and the reason is
    reported. Once this machine has shown a 2 s compile, the same run is worth timing."""
    monkeypatch.setenv("ONEGPU_CACHE", str(tmp_path))  # no compile seen on this machine yet
    monkeypatch.setattr(compile_auto, "_eager_s", lambda *a: 0.3)
    monkeypatch.setattr(compile_auto, "time_compile", _never)
    over = {"train.max_steps": "200", "train.micro_batch_size": "8", "model.init_std": "0.011"}
    built = build(_cfg(**over), CPU, with_data=False)
    assert built.cfg.train.compile == "none" and built.loss_fn is token_loss_sum
    assert "could save at most 8 s against at least 15 s" in built.compile_trial.skipped
    assert compile_auto.repay_bound(CPU, 0.3, 200) == pytest.approx((7.826, 15.0), abs=1e-3)
    _store("compile.json", f"{compile_auto.device_key(CPU)}|other-model",
           {"eager_step_s": 0.4, "compiled_step_s": 0.5, "compile_s": 2.0})  # fmt: skip
    assert compile_auto.repay_bound(CPU, 0.3, 200)[1] == 2.0
    timed = CompileTrial(0.3, 0.2, 2.0)
    monkeypatch.setattr(compile_auto, "time_compile", lambda *a: timed)
    trial = build(_cfg(**over), CPU, with_data=False).compile_trial
    assert (trial.eager_s, trial.compiled_s, trial.compile_s, trial.skipped) == (0.3, 0.2, 2.0, "")


def test_time_compile_leaves_no_gradients_and_the_rng_as_it_was():
    built = build(_cfg(**{"model.dropout": "0.1"}), CPU, with_data=False)
    x = torch.randint(0, 256, (4, 64))
    torch.manual_seed(5)
    before = torch.get_rng_state()
    left = []
    candidate = compile.Candidate(lambda: built.loss_fn, lambda: left.append(True))
    trial = time_compile(
        built.model, built.loss_fn, candidate, (x, x), lambda: built.policy.autocast(CPU), CPU
    )
    assert left == [True] * (compile_auto.PAIRS + 1)  # left before each eager run, and at the end
    assert torch.equal(torch.get_rng_state(), before)
    assert all(p.grad is None for p in built.model.parameters())
    assert trial.eager_s > 0 and trial.compiled_s > 0 and trial.compile_s >= 0


@pytest.mark.slow  # compiles a block for real (~10 s on a CPU)
def test_the_regional_trial_times_eager_as_eager_and_compiles_the_blocks():
    """Regression: the regional candidate was once entered before the eager runs, so 'eager'
    ran the compiled blocks and the compile was hidden in its warm-up."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    built = build(_cfg(), CPU, with_data=False)
    x = torch.randint(0, 256, (4, 64))
    graphs = counters["stats"]["unique_graphs"]
    candidate = compile.auto_candidates(built.model, built.loss_fn, lambda f: f, built.device)[
        "regional"
    ]
    trial = time_compile(
        built.model, built.loss_fn, candidate, (x, x), lambda: built.policy.autocast(CPU), CPU
    )
    assert counters["stats"]["unique_graphs"] > graphs  # the blocks were compiled ...
    assert all(b._compiled_call_impl is None for b in built.model.blocks)  # ... and left
    assert trial.compile_s > 10 * trial.compiled_s  # the compile shows in the compiled run


def test_info_counts_the_cached_choices():
    from onegpu.tools.info import cached_choices, device_info, format_info

    _store("compile.json", "counted", {"eager_step_s": 1.0, "compiled_step_s": 1.0, "compile_s": 1})
    stored = json.loads((cache_root() / "compile.json").read_text())
    assert cached_choices()["compile"] == len(stored)
    assert f"compile {len(stored)}" in format_info(device_info(measure=False))


def test_compile_auto_never_times_what_dynamo_cannot_trace():
    """Selective checkpointing's policy context does not trace under torch.compile here: `auto`
    keeps such a run eager instead of failing in the timing (it used to, in plan_accuracy)."""
    for policy in ("selective", "dots"):
        long = _cfg(**{"train.max_steps": 1000, "memory.checkpointing": policy})
        assert compile_auto.auto_candidate(long, CPU, distributed=False) == "none"
