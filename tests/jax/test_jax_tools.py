"""The tools on the JAX backend: bench's rows in JAX terms, and a profile trace."""

from __future__ import annotations

import gzip
import json

import pytest

from onegpu.tools.bench import GRIDS, _resolve
from onegpu.tools.bench_backend import for_backend, refused


def test_lippe_rows_become_unrolled_and_scanned_layers_on_jax():
    rows = dict(GRIDS["lippe"])
    whole = for_backend(rows["bf16 + compile whole (JAX: unrolled)"], "jax")
    regional = for_backend(rows["bf16 + compile regional (JAX: scan)"], "jax")
    assert "train.compile" not in whole and "model.scan_layers" not in whole
    assert regional["model.scan_layers"] == "true" and "train.compile" not in regional
    assert (
        for_backend(rows["bf16 + compile regional (JAX: scan)"], "torch")["train.compile"]
        == "regional"
    )
    remat = for_backend(rows["bf16 + remat block (JAX: scanned)"], "jax")
    assert remat["model.scan_layers"] == "true" and remat["memory.checkpointing"] == "block"
    for overrides in rows.values():  # every Lippe row has a JAX counterpart
        row = for_backend(_resolve(overrides, {"train.micro_batch_size": 8}), "jax")
        assert refused("tiny", None, {**row, "train.backend": "jax"}) == ""


def test_a_row_without_a_jax_counterpart_is_named_with_its_reason():
    why = refused("tiny", None, {"train.backend": "jax", "optim.name": "adamw8bit"})
    assert why.startswith("optim.name:")


@pytest.mark.slow
def test_profile_on_jax_writes_a_perfetto_trace(tmp_path):
    pytest.importorskip("jax")
    from onegpu.backends.jax.profile import profile_jax
    from onegpu.config import load_config

    cfg = load_config("tiny", overrides={"train.backend": "jax", "out.dir": str(tmp_path / "p")})
    result = profile_jax(cfg, steps=2, warmup=1)
    assert result["traces"], result
    with gzip.open(tmp_path / "p" / result["traces"][0]) as f:
        trace = json.loads(f.read())
    assert trace["traceEvents"]  # Perfetto's JSON trace format
    assert "step time" in (tmp_path / "p" / "summary.txt").read_text()
