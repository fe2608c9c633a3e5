"""The JAX backend equals the torch backend from the same weights: fp32, no dropout, the same
batches, 20 steps of AdamW with warmup, cosine decay and clipping, over two micro-batches."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("jax")

from onegpu.config import load_config  # noqa: E402
from onegpu.train import train  # noqa: E402

STEPS = 20
REL = 1e-4


def _cfg(out, **over):
    base = {"train.max_steps": STEPS, "train.log_every": 1, "train.eval_every": 10,
            "train.precision": "fp32", "train.micro_batch_size": 4, "out.progress": "false",
            "out.dir": str(out), "train.device": "cpu", "train.compile": "none"}  # fmt: skip
    return load_config("tiny", overrides={**base, **over})


def _instruction_file(folder):
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parents[1] / "data"))
    from instruction_sets import arithmetic_rows, write_jsonl

    return write_jsonl(folder / "pr.jsonl", arithmetic_rows(300))


def _losses(out):
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in rows if "loss" in r}, [
        r["val_loss"] for r in rows if "val_loss" in r
    ]


@pytest.fixture(scope="module")
def start(tmp_path_factory):
    """A model.safetensors of the torch backend (two steps from the torch initialisation)."""
    out = tmp_path_factory.mktemp("start")
    train(_cfg(out, **{"train.max_steps": 2, "train.eval_every": 0}))
    return out / "model.safetensors"


@pytest.mark.slow  # 35 s: the fast suite keeps the one-forward check (test_model.py)
@pytest.mark.parametrize(
    ("init_on", "over"),
    [
        ("torch", {}),
        ("jax", {}),
        ("torch", {"memory.loss_chunk": "96"}),
        (
            "torch",
            {"data.packing": "bfd", "data.max_len": "24", "data.train_on": "prompt+response"},
        ),
    ],  # 256 tokens a micro-batch: 3 chunks, the last padded
    ids=["from-torch", "from-jax", "chunked-loss", "packed-bfd"],
)
def test_both_backends_log_the_same_losses_from_the_same_weights(tmp_path, start, init_on, over):
    if "data.packing" in over:  # instruction data, examples cut to 24 tokens: 2-3 a row
        over = {**over, "data.source": str(_instruction_file(tmp_path))}
    if init_on == "jax":  # the other way round: a JAX run's weights start both
        train(_cfg(tmp_path / "jstart", **{"train.backend": "jax"}, **{"train.max_steps": 2, "train.eval_every": 0,
                                               "model.init_from": str(start)}))  # fmt: skip
        start = tmp_path / "jstart" / "model.safetensors"
    t = train(_cfg(tmp_path / "t", **{"model.init_from": str(start)}, **over))
    j = train(
        _cfg(tmp_path / "j", **{"train.backend": "jax"}, **{"model.init_from": str(start)}, **over)
    )
    (lt, vt), (lj, vj) = _losses(tmp_path / "t"), _losses(tmp_path / "j")
    assert lt.keys() == lj.keys() == set(range(1, STEPS + 1))
    for step in lt:
        assert lj[step] == pytest.approx(lt[step], rel=REL), (step, lt[step], lj[step])
    assert vj == pytest.approx(vt, rel=REL) and len(vt) == 2
    assert lt[STEPS] < lt[1] - 0.5  # it trained
    assert j["params"] == t["params"] and j["tokens"] == t["tokens"]
    if "data.packing" in over:  # rows of several examples each, the same on both backends
        assert t["data"]["rows"] < t["data"]["examples"] and j["data"] == t["data"]
