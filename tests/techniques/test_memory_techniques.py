"""Checkpointing, offloading and chunked loss compute what the plain step computes, in less memory."""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from onegpu.backends.torch.build import build
from onegpu.backends.torch.loader import IGNORE_INDEX
from onegpu.config import ConfigError, load_config

MODES = ["none", "attn", "mlp", "attn+mlp", "block", "every:2", "selective", "dots"]


def _built(**over):
    base = {
        "train.device": "cpu",
        "train.precision": "fp32",
        "model.n_layer": "4",
        "model.dropout": "0.1",
    }
    cfg = load_config("tiny", overrides=base | {k: str(v) for k, v in over.items()})
    return build(cfg, torch.device("cpu"), with_data=False)


def _step(built, x, y, seed=123):
    """Forward (dropout on) + backward; returns loss, grads, saved-activation bytes."""
    torch.manual_seed(seed)
    with built.saved_counter() as counter, built.policy.autocast(built.device):
        loss = built.loss_fn(built.model, x, y)
    loss.backward()
    grads = {n: p.grad.clone() for n, p in built.model.named_parameters()}
    return loss.detach(), grads, counter.bytes


@pytest.fixture(scope="module")
def batch():
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, 256, (4, 64), generator=g)
    y = torch.randint(0, 256, (4, 64), generator=g)
    y[1, 40:] = IGNORE_INDEX
    return x, y


@pytest.fixture(scope="module")
def reference(batch):
    return _step(_built(), *batch)


@pytest.mark.parametrize("mode", [*MODES[1:], "blocks:selective,attn+mlp,none,block"])
def test_checkpointing_keeps_gradients_with_dropout(mode, batch, reference):
    loss, grads, saved = _step(_built(**{"memory.checkpointing": mode}), *batch)
    ref_loss, ref_grads, ref_saved = reference
    assert torch.equal(loss, ref_loss)
    for name, g in grads.items():
        torch.testing.assert_close(g, ref_grads[name], rtol=1e-6, atol=1e-7, msg=name)
    assert saved < ref_saved


def test_checkpointing_saved_bytes_follow_the_expected_order(batch):
    saved = {m: _step(_built(**{"memory.checkpointing": m}), *batch)[2] for m in MODES}
    assert saved["block"] < saved["attn+mlp"] < saved["attn"] < saved["none"]
    assert saved["attn+mlp"] < saved["mlp"] < saved["none"]
    assert saved["block"] < saved["every:2"] < saved["none"]
    assert saved["block"] < saved["selective"] < saved["none"]  # matmul outputs kept
    assert saved["dots"] == saved["selective"]  # one policy on torch (the attention kernel kept)


def test_checkpointing_changes_no_parameter_name():
    plain, ckpt = _built(), _built(**{"memory.checkpointing": "attn+mlp"})
    assert plain.model.state_dict().keys() == ckpt.model.state_dict().keys()


def test_selective_recomputes_no_matmul(batch):
    """Counted, not only observed: selective checkpointing adds no matmul FLOPs in backward,
    whole-block checkpointing adds one forward's worth."""
    from torch.utils.flop_counter import FlopCounterMode

    def flops(mode):
        built = _built(**{"memory.checkpointing": mode, "model.attention": "plain"})
        with FlopCounterMode(display=False) as fc:
            built.loss_fn(built.model, *batch).backward()
        return fc.get_total_flops()

    none, block, selective = flops("none"), flops("block"), flops("selective")
    assert selective == none
    assert block > none


@pytest.mark.parametrize("mode", ["none", "block"])
def test_offloading_gives_the_same_gradients(mode, batch, reference):
    loss, grads, _ = _step(
        _built(**{"memory.offload_activations": "true", "memory.checkpointing": mode}), *batch
    )
    assert torch.equal(loss, reference[0])
    for name, g in grads.items():
        torch.testing.assert_close(g, reference[1][name], rtol=1e-6, atol=1e-7, msg=name)


class _LargestTensor(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in torch.utils._pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel() * t.element_size())
        return out


@pytest.mark.parametrize("tie", ["true", "false"])
def test_chunked_loss_same_loss_and_gradients(tie):
    common = {"model.dropout": "0.0", "model.vocab_size": "4096", "model.tie_embeddings": tie}
    x = torch.randint(0, 4096, (4, 64))
    y = torch.randint(0, 4096, (4, 64))
    y[2, 5:] = IGNORE_INDEX
    plain_loss, plain_grads, _ = _step(_built(**common, **{"memory.loss_chunk": "0"}), x, y)
    chunked = _built(**common, **{"memory.loss_chunk": "48"})  # does not divide 256 tokens
    loss, grads, _ = _step(chunked, x, y)
    torch.testing.assert_close(loss, plain_loss, rtol=1e-6, atol=0)
    for name, g in grads.items():  # equal up to fp32 summation order
        # + 1e-8: the key bias's gradient is zero by math (rounding noise on both sides)
        assert (g - plain_grads[name]).norm() < 1e-5 * plain_grads[name].norm() + 1e-8, name

    full_logits_bytes = x.numel() * 4096 * 4
    plain = _built(**common, **{"memory.loss_chunk": "0"})
    with _LargestTensor() as spy:
        plain.loss_fn(plain.model, x, y).backward()
    assert spy.largest == full_logits_bytes  # the spy sees the full logits when they exist
    with _LargestTensor() as spy:
        chunked.loss_fn(chunked.model, x, y).backward()
    # now the largest tensor is the [vocab, d_model] weight gradient, a quarter of the logits
    assert spy.largest < full_logits_bytes / 2


def test_chunked_linear_cross_entropy_with_bias_padding_and_ignored_rows():
    """The autograd function alone against F.cross_entropy: a biased head, a padded vocabulary
    (columns past n_valid never win), ignored rows and a last chunk shorter than the others."""
    import torch.nn.functional as F

    from onegpu.techniques.chunked_loss import ChunkedLinearCrossEntropy

    g = torch.Generator().manual_seed(0)
    n, d, vocab, n_valid = 70, 16, 136, 130
    h = torch.randn(n, d, generator=g, requires_grad=True)
    w = torch.randn(vocab, d, generator=g).requires_grad_()
    b = torch.randn(vocab, generator=g).requires_grad_()
    t = torch.randint(0, n_valid, (n,), generator=g)
    t[[0, 33, 69]] = IGNORE_INDEX
    logits = (h @ w.T + b)[:, :n_valid]
    F.cross_entropy(logits, t, ignore_index=IGNORE_INDEX, reduction="sum").mul(0.5).backward()
    want = [x.grad.clone() for x in (h, w, b)]
    for x in (h, w, b):
        x.grad = None
    loss = ChunkedLinearCrossEntropy.apply(h, w, b, t, 32, torch.float32, n_valid)
    loss.mul(0.5).backward()
    with torch.no_grad():
        plain = F.cross_entropy(logits, t, ignore_index=IGNORE_INDEX, reduction="sum")
    torch.testing.assert_close(loss, plain, rtol=1e-6, atol=0)
    for name, x, grad in zip("hwb", (h, w, b), want, strict=True):
        torch.testing.assert_close(x.grad, grad, rtol=1e-5, atol=1e-6, msg=name)
    assert w.grad[n_valid:].abs().max() == 0 and b.grad[n_valid:].abs().max() == 0


@pytest.mark.parametrize("precision", ["bf16", "bf16-pure"])
def test_chunked_loss_under_bf16_tracks_the_plain_path(precision, monkeypatch):
    """Under autocast the head's fp32 gradient is summed a block of rows at a time (here 100
    of 256); under bf16-pure in bf16 over the chunks, as autograd would sum a chunked loss's."""
    from onegpu.techniques import chunked_loss

    monkeypatch.setattr(chunked_loss, "VOCAB_BLOCK", 100)
    # attention pinned to the fp32 reference: `auto` times its kernels, and the keys' biases
    # have a gradient that is zero but for rounding (a constant shift of each score row)
    common = {"model.dropout": "0.0", "train.precision": precision, "model.attention": "plain"}
    x = torch.randint(0, 256, (4, 64))
    plain_loss, plain_grads, _ = _step(_built(**common, **{"memory.loss_chunk": "0"}), x, x)
    loss, grads, _ = _step(_built(**common, **{"memory.loss_chunk": "64"}), x, x)
    torch.testing.assert_close(loss, plain_loss, rtol=1e-3, atol=0)
    whole = torch.cat([g.flatten() for g in plain_grads.values()]).norm()
    for name, g in grads.items():
        # the keys' biases: rounding alone, judged against the whole gradient (on AMX, bf16
        # products round differently: 3e-5 apart at a norm of 5e-5)
        scale = whole if name.endswith(".k.bias") else plain_grads[name].norm()
        assert (g - plain_grads[name]).norm() < 1e-2 * scale + 1e-6, name


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("memory.checkpointing", "blocks"),
        ("memory.checkpointing", "every:0"),
        ("memory.checkpointing", "budget:-5"),
        ("memory.checkpointing", "budget:"),
        ("memory.checkpointing", "blocks:none*0"),
        ("memory.checkpointing", "blocks:fast,block"),
        ("memory.loss_chunk", "-1"),
    ],
)
def test_bad_memory_options_are_refused(key, value):
    with pytest.raises(ConfigError, match=key):
        load_config("tiny", overrides={key: value})


@pytest.mark.slow  # moved from the fast run to keep it under 5 minutes
def test_train_reports_the_memory_breakdown(tmp_path):
    from onegpu.train import train

    over = {
        "train.device": "cpu",
        "train.precision": "fp32",
        "train.max_steps": "3",
        "train.eval_every": "0",
        "out.progress": "false",
        "out.dir": str(tmp_path / "r"),
        "memory.checkpointing": "block",
        "train.measure_memory": "true",
    }
    s = train(load_config("tiny", overrides=over))
    mem = s["memory"]
    n = s["params"]
    assert mem["params"] == 4 * n  # fp32 parameters, exactly
    assert mem["grads"] == 4 * n
    assert 8 * n <= mem["optimizer"] <= 8 * n + 1024  # AdamW: two fp32 moments (+ step counters)
    assert mem["activations"] > 0 and mem["saved_activations_per_micro_batch"] > 0
    assert mem["peak"] == sum(
        mem[k] for k in ("params", "grads", "optimizer", "activations", "other")
    )


@pytest.mark.slow  # three profiled runs (8 s)
def test_breakdown_counts_states_the_profiler_does_not_recognise(tmp_path):
    """Adafactor's factored states are not labelled by the profiler: the exact count is used."""
    from onegpu.config import load_config
    from onegpu.train import train

    over = {
        "train.device": "cpu",
        "train.max_steps": "3",
        "train.eval_every": "0",
        "out.progress": "false",
        "out.dir": str(tmp_path / "r"),
        "optim.name": "adafactor",
        "train.measure_memory": "true",
    }
    s = train(load_config("tiny", overrides=over))
    mem, n = s["memory"], s["params"]
    assert 0 < mem["optimizer"] < n  # factored second moments: well under a byte per parameter
    assert mem["peak"] == sum(
        mem[k] for k in ("params", "grads", "optimizer", "activations", "other")
    )
