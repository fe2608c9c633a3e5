"""The JAX GPT: the torch GPT's function from the same weights, and scan / remat change how
it runs, never what it computes."""

from __future__ import annotations

import numpy as np
import pytest

jax = pytest.importorskip("jax")

import jax.numpy as jnp  # noqa: E402
import torch  # noqa: E402

from onegpu.backends.jax import weights  # noqa: E402
from onegpu.backends.jax.build import init_params  # noqa: E402
from onegpu.backends.jax.loss import token_loss_sum  # noqa: E402
from onegpu.backends.jax.model import GPT, precision_for  # noqa: E402
from onegpu.backends.torch.model import load_initial_weights  # noqa: E402
from onegpu.config import load_config  # noqa: E402
from onegpu.models.gpt import GPT as TorchGPT  # noqa: E402


def _cfg(**over):
    return load_config("tiny", overrides={"model.seq_len": 32, "train.precision": "fp32", **over})


def _model(cfg, ck="none", scan=False):
    return GPT(cfg.model, precision_for(cfg, False), ck, scan)


def _batch(cfg):
    rng = np.random.default_rng(0)
    return jnp.asarray(rng.integers(0, cfg.model.vocab_size, (2, cfg.model.seq_len + 1)))


@pytest.mark.parametrize("tie", ["true", "false"])
def test_the_torch_model_computes_the_same_logits_from_the_jax_weights(tmp_path, tie):
    cfg = _cfg(**{"model.tie_embeddings": tie})
    params = init_params(cfg, _model(cfg))
    path = tmp_path / "model.safetensors"
    weights.write_safetensors(jax.device_get(params), cfg.model, path)
    torch_model = TorchGPT(cfg.model)
    torch_model.init_weights()
    load_initial_weights(torch_model, str(path))
    x = _batch(cfg)[:, :-1]
    ours = np.asarray(_model(cfg).apply({"params": params}, x))[..., : cfg.model.vocab_size]
    with torch.no_grad():
        theirs = torch_model(torch.from_numpy(np.array(x))).numpy()[..., : cfg.model.vocab_size]
    np.testing.assert_allclose(ours, theirs, rtol=1e-4, atol=1e-5)
    # and back: the torch model's state dict fills the JAX tree to the same values
    state = {k: v.numpy() for k, v in torch_model.state_dict().items()}
    again = weights.from_torch_names(state, jax.device_get(params), cfg.model, "torch")
    for a, b in zip(
        jax.tree_util.tree_leaves(again), jax.tree_util.tree_leaves(params), strict=True
    ):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize("scan", [False, True])
def test_packed_rows_give_the_torch_models_logits_and_each_document_its_own(tmp_path, scan):
    from onegpu.models.documents import documents

    cfg = _cfg()
    model = _model(cfg, scan=scan)
    params = init_params(cfg, model)
    x = _batch(cfg)[:, :-1]
    positions = np.array([list(range(12)) + list(range(20)), list(range(7)) + list(range(25))])
    V = cfg.model.vocab_size
    ours = np.asarray(model.apply({"params": params}, x, positions_BT=positions))[..., :V]
    alone = np.asarray(model.apply({"params": params}, x[:1, 12:]))[..., :V]
    np.testing.assert_allclose(ours[:1, 12:], alone, rtol=1e-4, atol=1e-5)
    if scan:  # the torch model reads the unscanned tree
        return
    path = tmp_path / "model.safetensors"
    weights.write_safetensors(jax.device_get(params), cfg.model, path)
    torch_model = TorchGPT(cfg.model)
    torch_model.init_weights()
    load_initial_weights(torch_model, str(path))
    with torch.no_grad(), documents(torch_model, torch.from_numpy(positions)):
        theirs = torch_model(torch.from_numpy(np.array(x))).numpy()[..., :V]
    np.testing.assert_allclose(ours, theirs, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize(
    ("ck", "scan"),
    [("selective", False)]
    + [pytest.param(*case, marks=pytest.mark.slow) for case in
       [("none", True), ("attn+mlp", False), ("block", True), ("selective", True), ("every:2", False), ("dots", True),
        ("mlp", True)]],
)  # fmt: skip
def test_scan_and_remat_keep_loss_and_gradients(ck, scan):
    cfg = _cfg(**{"model.n_layer": 3})
    plain = _model(cfg)
    params = init_params(cfg, plain)
    tokens = _batch(cfg)
    x, y = tokens[:, :-1], tokens[:, 1:]
    other = _model(cfg, ck, scan)
    if scan:  # the same weights, stacked on a layer axis
        state = weights.to_torch_names(jax.device_get(params), cfg.model)
        template = jax.device_get(init_params(cfg, other))
        other_params = weights.from_torch_names(state, template, cfg.model, "unrolled")
    else:
        other_params = params

    def loss(model, p):
        return token_loss_sum(model.apply({"params": p}, x), y)

    l0, g0 = jax.jit(jax.value_and_grad(lambda p: loss(plain, p)))(params)
    l1, g1 = jax.jit(jax.value_and_grad(lambda p: loss(other, p)))(other_params)
    np.testing.assert_allclose(float(l1), float(l0), rtol=1e-6)
    flat0 = weights.to_torch_names(jax.device_get(g0), cfg.model)
    flat1 = weights.to_torch_names(jax.device_get(g1), cfg.model)
    assert flat0.keys() == flat1.keys()
    for k in flat0:  # equal up to float32 reassociation (XLA fuses the two differently)
        # + 1e-8: the key bias's gradient is zero by math (rounding noise on both sides)
        assert np.linalg.norm(flat1[k] - flat0[k]) <= 1e-5 * np.linalg.norm(flat0[k]) + 1e-8, k


@pytest.mark.slow  # four compiles of a 4-layer model
def test_remat_policies_order_xla_temporaries_as_they_save():
    """XLA's plan of a scanned step: `dots` keeps more than `selective` (attention's batched
    matmuls too), which keeps more than whole-block remat, all less than no remat."""
    cfg = _cfg(**{"model.n_layer": 4, "model.seq_len": 64})
    x = jnp.zeros((4, 64), jnp.int32)

    def temp_bytes(ck):
        model = _model(cfg, ck, scan=True)
        params = init_params(cfg, model)
        grad = jax.jit(jax.grad(lambda p: token_loss_sum(model.apply({"params": p}, x), x)))
        return grad.lower(params).compile().memory_analysis().temp_size_in_bytes

    got = {ck: temp_bytes(ck) for ck in ("none", "dots", "selective", "block")}
    assert got["block"] < got["selective"] < got["dots"] < got["none"], got
