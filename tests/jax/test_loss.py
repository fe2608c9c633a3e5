"""The chunked output layer + loss on JAX computes the plain loss and its gradients, ignored
targets and vocabulary padding included, and `auto` chunks only where the logits are large."""

from __future__ import annotations

import numpy as np
import pytest

jax = pytest.importorskip("jax")

import jax.numpy as jnp  # noqa: E402

from onegpu.backends.jax import loss_chunk  # noqa: E402
from onegpu.backends.jax.build import init_params  # noqa: E402
from onegpu.backends.jax.loss import IGNORE_INDEX, make_loss  # noqa: E402
from onegpu.backends.jax.model import GPT, precision_for  # noqa: E402
from onegpu.config import load_config  # noqa: E402


def _cfg(**over):
    base = {"model.seq_len": 32, "train.precision": "fp32", "model.vocab_size": 300,
            "model.pad_vocab_to": 64}  # fmt: skip
    return load_config("tiny", overrides=base | over)


@pytest.mark.parametrize(
    ("tie", "bias", "chunk"),
    [("true", "false", 24)]  # slow: the untied head, its bias, padded last chunks
    + [pytest.param(*c, marks=pytest.mark.slow) for c in [("false", "true", 7), ("false", "false", 64)]],
)  # fmt: skip
def test_the_chunked_loss_gives_the_plain_loss_and_gradients(tie, bias, chunk):
    cfg = _cfg(**{"model.tie_embeddings": tie, "model.bias": bias})
    model = GPT(cfg.model, precision_for(cfg, False))
    params = init_params(cfg, model)
    rng = np.random.default_rng(0)
    tokens = jnp.asarray(rng.integers(0, cfg.model.vocab_size, (3, cfg.model.seq_len + 1)))
    x, y = tokens[:, :-1], tokens[:, 1:].at[1, 20:].set(IGNORE_INDEX)
    key = jax.random.key(0)

    def value_and_grad(c):
        fn = make_loss(model, cfg, c)
        return jax.jit(jax.value_and_grad(lambda p: fn(p, x, y, key, True)))(params)

    (l0, g0), (l1, g1) = value_and_grad(0), value_and_grad(chunk)
    np.testing.assert_allclose(float(l1), float(l0), rtol=1e-6)
    flat0 = jax.tree_util.tree_leaves_with_path(g0)
    flat1 = dict(jax.tree_util.tree_leaves_with_path(g1))
    assert len(flat0) == len(flat1)
    for path, a in flat0:
        b = flat1[path]
        # + 1e-8: the key bias's gradient is zero by math (rounding noise on both sides)
        assert np.linalg.norm(b - a) <= 1e-5 * np.linalg.norm(a) + 1e-8, path


def test_auto_chunks_only_large_logits_and_takes_the_timed_choice(monkeypatch):
    small = _cfg().model
    monkeypatch.setattr(loss_chunk, "measure_loss_chunk", lambda *a: pytest.fail("timed"))
    assert loss_chunk.resolve_loss_chunk("auto", small, 4096, jnp.float32) == 0
    assert loss_chunk.resolve_loss_chunk(512, small, 4096, jnp.float32) == 512
    big = load_config("seed-ref").model  # GPT-2's 50k vocabulary
    timed = {"chunk": 2048, "seconds": {"0": 1.0, "1024": 1.2, "2048": 1.04, "4096": 1.0}}
    monkeypatch.setattr(loss_chunk, "measure_loss_chunk", lambda *a: timed)
    assert loss_chunk.resolve_loss_chunk("auto", big, 8192, jnp.float32) == 2048
