"""`model.attention blocked`: exact attention that skips the masked query blocks and saves its
probabilities; checked against fp64 SDPA, by counting its products and its saved bytes, and
inside the model under checkpointing, offload and `auto`."""

import pytest
import torch
import torch.nn.functional as F
from torch.utils.flop_counter import FlopCounterMode

from onegpu.backends.torch.build import build
from onegpu.config import load_config
from onegpu.models.blocked_attention import blocked_attention
from onegpu.models.documents import document_mask
from onegpu.perf.attention_blocks import query_blocks, saved_prob_bytes


def _qkv(B, H, T, K, dtype, seed=0):
    """Laid out as the model makes them: [B, T, H, K] seen as [B, H, T, K]."""
    g = torch.Generator().manual_seed(seed)
    return [
        torch.randn(B, T, H, K, generator=g, dtype=torch.float32)
        .to(dtype)
        .transpose(1, 2)
        .requires_grad_()
        for _ in range(3)
    ]


def _two_documents(B, T):
    half = T // 3
    return document_mask(torch.cat([torch.arange(half), torch.arange(T - half)]).expand(B, T))


def _errors(fn, q, k, v, dy, mask=None):
    """Max |error| of the output and of each gradient against fp64 SDPA, each relative to the
    largest value of what it measures."""
    ref_in = [x.detach().double().requires_grad_() for x in (q, k, v)]
    ref = F.scaled_dot_product_attention(*ref_in, attn_mask=mask, is_causal=mask is None)
    ref.backward(dy.double())
    y = fn(q, k, v, mask)
    y.backward(dy)
    pairs = [(y, ref)] + [(a.grad, b.grad) for a, b in zip((q, k, v), ref_in, strict=True)]
    return [((a.double() - b).abs().max() / b.abs().max()).item() for a, b in pairs]


@pytest.mark.parametrize("T", [48, 256, 300, 515])
@pytest.mark.parametrize("masked", [False, True], ids=["causal", "documents"])
def test_blocked_attention_is_exact_in_fp32(T, masked):
    """1 to 4 query blocks, uneven ones included: outputs and gradients of fp64 SDPA."""
    q, k, v = _qkv(2, 3, T, 16, torch.float32)
    dy = torch.randn(2, 3, T, 16)
    mask = _two_documents(2, T) if masked else None
    assert max(_errors(blocked_attention, q, k, v, dy, mask)) < 1e-5


@pytest.mark.parametrize("logit_scale", [1.0, 4.0, 8.0])
def test_blocked_attention_in_bf16_is_within_twice_the_flash_kernels_error(logit_scale):
    """In bf16, at the shape model B runs, with queries scaled so that the logits spread 1x,
    4x and 8x wider, each error (output, dq, dk, dv against fp64) stays within twice that of
    torch's flash kernel. Checked: with the scores rounded to bf16 (one 16-bit product), the
    4x case fails (output error 6.7x flash's)."""
    dy = torch.randn(4, 6, 256, 64, generator=torch.Generator().manual_seed(1)).bfloat16()

    def flash(q, k, v, mask):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)

    def scaled():
        q, k, v = _qkv(4, 6, 256, 64, torch.bfloat16)
        return [(q.detach() * logit_scale).requires_grad_(), k, v]

    blocked = _errors(blocked_attention, *scaled(), dy)
    fused = _errors(flash, *scaled(), dy)
    assert all(b < 2 * f for b, f in zip(blocked, fused, strict=True)), (blocked, fused)
    assert max(blocked) < 3e-2


def test_autocast_leaves_its_fp32_scores_fp32():
    """Under bf16 autocast (how the model runs it) the output is the one without autocast, to
    the bit: autocast would otherwise cast the fp32 score product back to bf16."""
    q, k, v = _qkv(2, 3, 256, 16, torch.bfloat16)
    plain = blocked_attention(q, k, v)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        autocast = blocked_attention(q, k, v)
    assert torch.equal(plain, autocast)


def test_the_masked_query_blocks_are_never_multiplied():
    """Counted: each block multiplies its rows by the keys before its end only, forward (2
    products) and backward (4), 5/8 of the full square at 4 blocks."""
    B, H, T, K = 2, 2, 512, 32
    q, k, v = _qkv(B, H, T, K, torch.float32)
    with FlopCounterMode(display=False) as counter:
        blocked_attention(q, k, v).sum().backward()
    seen = sum((end - start) * end for start, end in query_blocks(T))
    assert len(query_blocks(T)) == 4 and seen == T * T * 5 // 8
    assert counter.get_total_flops() == 6 * 2 * B * H * K * seen


def _bmm_copies(fn, *args) -> int:
    """How many times the batched matmuls copied an operand (`aten::bmm > aten::contiguous >
    aten::clone`) in one forward + backward of `fn`."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        fn(*args).sum().backward()
    events = sorted(prof.events(), key=lambda e: (e.time_range.start, -e.time_range.end))
    copies, stack = 0, []
    for e in events:
        while stack and stack[-1].time_range.end <= e.time_range.start:
            stack.pop()
        names = [s.name for s in stack[-2:]]
        copies += e.name == "aten::clone" and names == ["aten::bmm", "aten::contiguous"]
        stack.append(e)
    return copies


def test_each_query_blocks_rows_are_copied_once_not_in_every_product():
    """A block's rows sliced from one heads-major tensor are no compact batch of matrices: the
    CPU's batched matmul copied them in each of the three products that read them (9 copies a
    layer at 2 blocks). Each block's queries and output gradient are now heads-major tensors
    of their own; only the earlier blocks' key and value prefixes are still copied (value in
    forward, value and key in backward)."""
    B, H, T, K = 2, 2, 256, 32
    assert len(query_blocks(T)) == 2
    copies = _bmm_copies(blocked_attention, *_qkv(B, H, T, K, torch.bfloat16))
    assert copies <= 3 * (len(query_blocks(T)) - 1)


def test_compiled_its_forward_runs_atens_softmax_bit_for_bit():
    """Inductor's fused softmax computes each exponential twice; the causal softmax is an op of
    its own (onegpu::causal_softmax) that inductor calls as it is, so compiled and eager
    probabilities, and outputs, are the same bits. (Backward's softmax gradient is inductor's
    to fuse: within rounding, test_compiled_blocked_attention_tracks_eager.)"""
    shape = (2, 3, 256, 32)
    compiled = torch.compile(blocked_attention, dynamic=False, fullgraph=True)
    with torch.no_grad():
        for seed in range(3):
            q, k, v = _qkv(*shape, torch.bfloat16, seed=seed)
            assert torch.equal(compiled(q, k, v), blocked_attention(q, k, v))


def test_it_saves_the_bytes_the_planner_counts():
    """What backward keeps is q (a heads-major copy per query block), k, v (heads-major
    copies: they replace the projections' outputs) and exactly saved_prob_bytes of 16-bit
    probabilities."""
    B, H, T, K = 2, 3, 384, 16
    q, k, v = _qkv(B, H, T, K, torch.bfloat16)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        blocked_attention(q, k, v)
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in saved}
    qkv_bytes = 3 * B * T * H * K * 2
    assert sum(storages.values()) - qkv_bytes == saved_prob_bytes(B, H, T, 2)
    assert saved_prob_bytes(B, H, T, 2) == B * H * T * T * 2 * 4 // 6


def _model_step(**over):
    base = {
        "train.device": "cpu",
        "train.precision": "bf16",
        "model.n_layer": "2",
        "model.seq_len": "256",
        "model.attention": "blocked",
    }
    cfg = load_config("tiny", overrides=base | over)
    built = build(cfg, torch.device("cpu"), with_data=False)
    g = torch.Generator().manual_seed(0)
    x, y = (torch.randint(0, 256, (2, 256), generator=g) for _ in range(2))
    with built.policy.autocast(built.device):
        loss = built.loss_fn(built.model, x, y)
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in built.model.named_parameters()}


@pytest.mark.parametrize(
    "over",
    [
        {"memory.checkpointing": "block"},
        {"memory.checkpointing": "selective"},
        {"memory.checkpointing": "attn"},
        {"memory.offload_activations": "true"},
    ],
    ids=lambda o: "=".join(next(iter(o.items()))),
)
def test_recomputed_or_offloaded_blocked_attention_gives_the_same_gradients(over):
    """bf16, in the model: recomputing the kernel's forward or parking what it saves on the
    host changes no bit of the loss or the gradients."""
    ref_loss, ref_grads = _model_step()
    loss, grads = _model_step(**over)
    assert torch.equal(loss, ref_loss)
    for name, g in grads.items():
        assert torch.equal(g, ref_grads[name]), name


@pytest.mark.slow
def test_compiled_blocked_attention_tracks_eager():
    """Inductor traces the autograd.Function (forward and backward) and may fuse its softmax:
    the same loss, and each gradient within 1% of eager's norm (bf16 rounding; measured
    <= 0.4%, below SDPA's own compiled-vs-eager difference). The keys' biases are left out:
    their gradient is zero but for rounding (a constant shift of each score row)."""
    ref_loss, ref_grads = _model_step()
    loss, grads = _model_step(**{"train.compile": "default"})
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=0)
    for name, g in grads.items():
        if not name.endswith("attn.k.bias"):
            error = (g.float() - ref_grads[name].float()).norm() / ref_grads[name].float().norm()
            assert error < 1e-2, (name, error)
