"""`onegpu plan --largest`: the boundary of what fits, found by planning a few sizes."""

import dataclasses

import pytest

from onegpu.config import load_config, with_overrides
from onegpu.plan.largest import find_largest, format_largest
from onegpu.plan.memory import plan_memory
from onegpu.plan.shapes import Shape, ladder, shape_of, with_shape


def _cfg():
    return load_config("tiny", overrides={"train.device": "cpu", "train.precision": "fp32",
                                          "model.dropout": "0.0", "train.batch_size": "2",
                                          "train.micro_batch_size": "2"})  # fmt: skip


@pytest.mark.slow  # ~30 s: a dozen sizes planned, several with the fix list
def test_the_largest_size_fits_and_the_next_one_up_does_not():
    """The budget is exactly one rung's planned peak as configured: that rung fits, what is
    reported fits (planned in full with its changes), and the next rung up does not."""
    cfg = _cfg()
    sizes = ladder(shape_of(cfg))
    rung = sizes[len(sizes) // 2 + 2]
    budget = plan_memory(with_shape(cfg, rung)).memory["peak"]
    found = find_largest(cfg, None, budget, host_memory=2**40, log=lambda line: None)
    best = found["largest"]
    assert best["fits"] and best["params"] >= plan_memory(with_shape(cfg, rung)).n_params
    best_cfg = with_overrides(with_shape(cfg, Shape(**best["shape"])), best["overrides"])
    assert plan_memory(best_cfg).memory["peak"] <= budget
    nxt = found["next"]
    assert nxt is not None and not nxt["fits"] and nxt["params"] > best["params"]
    assert sizes.index(Shape(**nxt["shape"])) == sizes.index(Shape(**best["shape"])) + 1
    text = format_largest(found)
    assert "largest:" in text and "next size up" in text and "--model.n_layer" in text


def test_largest_needs_a_device_to_fit(capsys):
    from onegpu.cli import main

    assert main(["plan", "--preset", "tiny", "--largest"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--gpu" in err[0] and "Traceback" not in err[0]


def test_shapes_keep_the_rest_of_the_configuration():
    cfg = _cfg()
    big = with_shape(cfg, dataclasses.replace(shape_of(cfg), n_layer=9))
    assert big.model.n_layer == 9 and big.train == cfg.train and big.optim == cfg.optim
