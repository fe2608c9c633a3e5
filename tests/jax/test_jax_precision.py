"""`train.precision auto` on JAX follows a measurement of this machine: bf16 only where XLA
multiplies the step's products in bf16 clearly faster than in fp32 (backends/jax/precision.py)."""

from __future__ import annotations

import pytest

pytest.importorskip("jax")

from onegpu.backends.jax import precision  # noqa: E402
from onegpu.backends.jax.build import build  # noqa: E402
from onegpu.config import load_config  # noqa: E402


def _cfg(**over):
    values = {"train.backend": "jax", "train.precision": "auto", "model.init_std": "0.02", **over}
    return load_config("tiny", overrides=values)


@pytest.mark.parametrize(
    ("fp32_s", "bf16_s", "pays"), [(1.0, 0.5, True), (1.0, 0.95, False), (1.0, 1.2, False)]
)
def test_auto_precision_follows_the_measured_products(monkeypatch, tmp_path, fp32_s, bf16_s, pays):
    monkeypatch.setenv("ONEGPU_CACHE", str(tmp_path))
    measured = []

    def measure(shape):
        measured.append(shape)
        return {"fp32_s": fp32_s, "bf16_s": bf16_s}

    monkeypatch.setattr(precision, "measure_products", measure)
    cfg = _cfg()
    assert precision.bf16_pays(cfg) is pays
    assert precision.bf16_pays(cfg) is pays  # the second time reads the cache
    m = cfg.model
    tokens = cfg.train.micro_batch_size * cfg.train_seq_len
    assert measured == [(tokens, m.d_model, m.mlp_ratio * m.d_model)]


@pytest.mark.slow  # two JAX builds
def test_the_build_takes_the_measured_choice_for_auto_only(monkeypatch, tmp_path):
    monkeypatch.setenv("ONEGPU_CACHE", str(tmp_path))
    monkeypatch.setattr(precision, "measure_products", lambda shape: {"fp32_s": 1.0, "bf16_s": 0.5})
    assert build(_cfg()).precision.name == "bf16"
    assert build(_cfg(**{"train.precision": "fp32"})).precision.name == "fp32"


def test_the_measurement_times_both_dtypes_on_this_machine():
    found = precision.measure_products((64, 32, 128))
    assert found["fp32_s"] > 0 and found["bf16_s"] > 0
