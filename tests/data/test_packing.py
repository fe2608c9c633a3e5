"""Rows of examples: one example a row trains exactly as the example would alone (causal
attention never reaches the padding after it), where windows of the stream let an example
attend to the one before it; over-long examples are truncated or dropped, and counted."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from instruction_sets import arithmetic_rows, write_jsonl

from onegpu.config import ConfigError, DataConfig
from onegpu.data.tokens import prepare_tokens
from onegpu.data.windows import IGNORE_INDEX, example_rows

T = 48


def _splits(tmp_path, packing: str, seq_len: int = T, **over):
    rows = arithmetic_rows(12)
    source = str(write_jsonl(tmp_path / "pr.jsonl", rows))
    data = DataConfig(
        source=source, cache_dir=str(tmp_path), val_fraction=0, packing=packing, **over
    )
    return prepare_tokens(data, 256).cut(data, seq_len)


def _gpt(tiny_cfg):
    from onegpu.models.gpt import GPT

    torch.manual_seed(0)
    model = GPT(tiny_cfg.model)
    model.init_weights()
    return model.eval()


def _llama():
    import transformers
    from conftest import make_hf_config

    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(make_hf_config("llama")).eval()


def _logits(model, x: torch.Tensor) -> torch.Tensor:
    out = model(x)
    return out.logits if hasattr(out, "logits") else out


def _loss_and_grads(model, x: torch.Tensor, y: torch.Tensor):
    model.zero_grad(set_to_none=True)
    logits = _logits(model, x)
    loss = torch.nn.functional.cross_entropy(
        logits.flatten(0, 1).float(), y.flatten(), ignore_index=IGNORE_INDEX
    )
    loss.backward()
    return loss.detach(), [p.grad.clone() for p in model.parameters() if p.grad is not None]


@pytest.mark.parametrize("arch", ["gpt", "llama"])
def test_one_example_a_row_trains_as_the_example_alone_and_the_stream_leaks(
    tmp_path, tiny_cfg, arch
):
    model = _gpt(tiny_cfg) if arch == "gpt" else _llama()
    splits = _splits(tmp_path, "none")
    rows, tokens, mask = splits.train_rows, splits.train, splits.train_mask
    for i in (1, 5):
        x, y = (torch.from_numpy(a)[None] for a in rows.pair(i))
        start, end = rows.spans[i]
        alone = torch.from_numpy(tokens[start:end].astype(np.int64))[None]
        alone_y = alone[:, 1:].clone()
        alone_y[torch.from_numpy(mask[start + 1 : end].copy())[None] == 0] = IGNORE_INDEX
        row_loss, row_grads = _loss_and_grads(model, x, y)
        own_loss, own_grads = _loss_and_grads(model, alone[:, :-1], alone_y)
        torch.testing.assert_close(row_loss, own_loss, rtol=1e-6, atol=0)
        for a, b in zip(row_grads, own_grads, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
    # windows of the stream: the second example of a window sees the first one
    x, _ = (torch.from_numpy(a)[None] for a in _splits(tmp_path, "stream").train_rows.pair(0))
    second, _ = rows.spans[1]  # example 1 starts inside window 0, after example 0
    assert 0 < second < T
    alone = torch.from_numpy(tokens[second:T].astype(np.int64))[None]
    with torch.no_grad():
        leak = _logits(model, x)[:, second:] - _logits(model, alone)
    assert leak.abs().max() > 1e-3


def test_over_long_examples_are_truncated_or_dropped_and_counted():
    tokens = np.arange(30, dtype=np.uint16)
    starts = np.array([0, 5, 25])  # lengths 5, 20, 5
    cut = example_rows(tokens, starts, 8)
    assert cut.stats["overlong"] == 1 and cut.stats["tokens_lost"] == 20 - 9
    x, y = cut.pair(1)
    assert x.tolist() == list(range(5, 13)) and y.tolist() == list(range(6, 14))
    x, y = cut.pair(0)
    assert x.tolist()[:4] == [0, 1, 2, 3] and y.tolist()[4:] == [IGNORE_INDEX] * 4
    dropped = example_rows(tokens, starts, 8, drop_overlong=True)
    assert len(dropped) == 2 and dropped.stats["dropped"] == 1
    assert dropped.stats["tokens_lost"] == 20
    assert dropped.stats["padding"] == pytest.approx(1 - 8 / 16)


def test_auto_packs_text_as_a_stream_and_examples_one_a_row(tmp_path):
    assert _splits(tmp_path, "auto").packing == "none"
    (tmp_path / "a.txt").write_text("some text\n" * 300)
    text = DataConfig(source=str(tmp_path / "a.txt"), cache_dir=str(tmp_path))
    assert prepare_tokens(text, 256).cut(text, T).packing == "stream"
    np.arange(5000, dtype=np.uint16).tofile(tmp_path / "t.bin")
    tokens = DataConfig(source=str(tmp_path / "t.bin"), packing="none")
    with pytest.raises(ConfigError, match="data.packing"):
        prepare_tokens(tokens, 8192).cut(tokens, T)


PACKED_T = 128  # rows of two or three arithmetic examples


def _built_model(arch: str, hf_folder):
    """Our GPT or a tiny Llama through onegpu's build (the HF adapter), fp32, in eval mode."""
    from conftest import hf_overrides

    from onegpu.backends.torch.build import build
    from onegpu.config import load_config

    over = {"model.seq_len": str(PACKED_T), "train.device": "cpu", "train.precision": "fp32"}
    if arch == "llama":
        over = hf_overrides(hf_folder("llama"), seq_len=PACKED_T)
    cfg = load_config("tiny", overrides=over)
    return build(cfg, torch.device("cpu"), with_data=False).model.eval()


def _example_losses(model, x, y, positions, groups):
    """Each example's summed loss in one forward of the row (`groups`: its target slices)."""
    from onegpu.models.documents import documents

    with documents(model, positions):
        logits = _logits(model, x)
    per_token = torch.nn.functional.cross_entropy(
        logits[0].float(), y[0], ignore_index=IGNORE_INDEX, reduction="none"
    )
    return [per_token[g].sum() for g in groups]


@pytest.mark.parametrize("packing", ["greedy", "bfd"])
@pytest.mark.parametrize("arch", ["gpt", "llama"])
def test_packed_examples_train_as_each_alone_and_without_isolation_they_leak(
    tmp_path, hf_folder, arch, packing
):
    model = _built_model(arch, hf_folder)
    splits = _splits(tmp_path, packing, PACKED_T)
    rows, tokens, mask = splits.train_rows, splits.train, splits.train_mask
    assert rows.isolated and len(rows) < len(rows.spans)  # several examples share rows
    row = next(i for i in range(len(rows)) if rows.offsets[i + 1] - rows.offsets[i] >= 2)
    x, y, pos = (torch.from_numpy(a)[None] for a in rows.row(row))
    examples = rows.packs[rows.offsets[row] : rows.offsets[row + 1]]
    groups, at = [], 0
    for e in examples:
        n = int(rows.spans[e][1] - rows.spans[e][0]) - 1
        groups.append(slice(at, at + n))
        at += n
    params = [p for p in model.parameters() if p.requires_grad]
    packed = _example_losses(model, x, y, pos, groups)
    for e, loss, g in zip(examples, packed, groups, strict=True):
        start, end = rows.spans[e]
        alone = torch.from_numpy(tokens[start:end].astype(np.int64))[None]
        alone_y = alone[:, 1:].clone()
        alone_y[torch.from_numpy(mask[start + 1 : end].copy())[None] == 0] = IGNORE_INDEX
        assert torch.equal(alone[:, :-1], x[:, g]) and torch.equal(alone_y, y[:, g])
        own = _example_losses(model, alone[:, :-1], alone_y, None, [slice(None)])[0]
        torch.testing.assert_close(loss, own, rtol=1e-6, atol=1e-6)
        packed_grads = torch.autograd.grad(loss, params, retain_graph=True, allow_unused=True)
        own_grads = torch.autograd.grad(own, params, allow_unused=True)
        for a, b in zip(packed_grads, own_grads, strict=True):
            if a is None or b is None:
                assert a is None and b is None
                continue
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
    # the same row without isolation: the second example attends to the first
    leaked = _example_losses(model, x, y, None, groups)
    assert abs(float(leaked[1].detach() - packed[1].detach())) > 1e-3
    if arch == "gpt":  # its own positions but no mask: attention alone leaks
        from onegpu.models.gpt import Attention

        with torch.no_grad():
            model.use_positions(pos)
            for module in model.modules():
                if isinstance(module, Attention):
                    module.document_mask = None
            unmasked = _logits(model, x)
            model.use_positions(None)
        per_token = torch.nn.functional.cross_entropy(
            unmasked[0].float(), y[0], ignore_index=IGNORE_INDEX, reduction="none"
        )
        assert abs(float(per_token[groups[1]].sum() - packed[1].detach())) > 1e-3


def test_greedy_keeps_the_order_and_bfd_fills_the_fewest_rows():
    from onegpu.data.packing import best_fit_decreasing, next_fit

    lengths = np.array([5, 3, 7, 2, 4, 6, 1, 8])
    order, offsets = next_fit(lengths, 10)
    assert order.tolist() == list(range(8))
    assert [lengths[order[a:b]].tolist() for a, b in zip(offsets[:-1], offsets[1:])] == [
        [5, 3],
        [7, 2],
        [4, 6],
        [1, 8],
    ]
    order, offsets = best_fit_decreasing(lengths, 10)
    rows = [lengths[order[a:b]].tolist() for a, b in zip(offsets[:-1], offsets[1:])]
    assert sorted(sum(rows, [])) == sorted(lengths.tolist())
    assert all(sum(r) <= 10 for r in rows) and len(rows) == 4  # 36 positions: 4 rows at least
    assert rows[0] == [8, 2]  # the longest first, topped up with the best fit
    rng = np.random.default_rng(0)
    many = rng.integers(1, 48, size=500)
    greedy_rows = len(next_fit(many, 48)[1]) - 1
    bfd_rows = len(best_fit_decreasing(many, 48)[1]) - 1
    assert bfd_rows < greedy_rows and bfd_rows <= -(-int(many.sum()) // 48) * 11 / 9 + 1


@pytest.mark.parametrize("packing", ["greedy", "bfd"])
def test_packed_rows_hold_every_example_once_and_pad_less_than_one_a_row(tmp_path, packing):
    one = _splits(tmp_path, "none", PACKED_T).train_rows
    packed = _splits(tmp_path, packing, PACKED_T).train_rows
    assert sorted(packed.packs.tolist()) == list(range(len(one.spans)))
    assert packed.stats["examples"] == one.stats["examples"]
    assert packed.stats["padding"] < one.stats["padding"] and len(packed) < len(one)
    trained = sum(int((packed.row(i)[1] != IGNORE_INDEX).sum()) for i in range(len(packed)))
    assert trained == sum(int((one.pair(i)[1] != IGNORE_INDEX).sum()) for i in range(len(one)))


def _packed_step_grads(tmp_path, hf_folder, arch: str, **over):
    """One packed batch's loss and gradients through the production step of a build."""
    from conftest import hf_overrides

    from onegpu.backends.torch.build import build
    from onegpu.backends.torch.loader import count_targets
    from onegpu.config import load_config

    base = {"model.seq_len": str(PACKED_T), "train.device": "cpu", "train.precision": "fp32"}
    base["model.attention"] = "sdpa"  # pinned: packed and plain rows would each time theirs
    if arch == "llama":
        base = hf_overrides(hf_folder("llama"), seq_len=PACKED_T)
    base |= {"train.batch_size": "4", "train.micro_batch_size": "4", "train.compile": "none"}
    cfg = load_config("tiny", overrides={**base, **over})
    built = build(cfg, torch.device("cpu"), with_data=False)
    rows = _splits(tmp_path, "bfd", PACKED_T).train_rows
    x, y, pos = (torch.from_numpy(np.stack(a)) for a in zip(*(rows.row(i) for i in range(4))))
    loss = built.step.forward_backward(x, y, count_targets(y), pos)
    return loss, [p.grad.clone() for p in built.model.parameters() if p.grad is not None]


@pytest.mark.parametrize(
    "over",
    [
        {"memory.checkpointing": "block", "train.micro_batch_size": "2"},
        {"memory.checkpointing": "selective"},
        pytest.param(
            {"train.compile": "regional", "memory.checkpointing": "block"}, marks=pytest.mark.slow
        ),
    ],  # fmt: skip
    ids=["block-4-micro", "selective", "regional-compile"],
)
@pytest.mark.parametrize("arch", ["gpt", "llama"])
def test_packed_batches_through_the_step_keep_their_gradients_under_each_technique(
    tmp_path, hf_folder, arch, over
):
    """Recomputation in backward reads the same documents as the forward; accumulation
    splits the positions with the rows."""
    plain_loss, plain = _packed_step_grads(tmp_path, hf_folder, arch)
    loss, grads = _packed_step_grads(tmp_path, hf_folder, arch, **over)
    torch.testing.assert_close(loss, plain_loss, rtol=1e-6, atol=1e-6)
    assert len(grads) == len(plain)
    for a, b in zip(grads, plain, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("arch", ["gpt", pytest.param("llama", marks=pytest.mark.slow)])
def test_the_planner_follows_the_packed_step(hf_folder, arch):
    """A packed step (explicit masks, position embeddings from the rows' positions) is planned
    like a real one: the planned peak within 5% of the measured, the saved bytes exact."""
    from conftest import hf_overrides

    from onegpu.backends.torch.step_memory import measure_real_step
    from onegpu.config import load_config
    from onegpu.plan.memory import plan_memory

    base = {"model.seq_len": str(PACKED_T), "train.device": "cpu", "train.precision": "fp32"}
    base["model.attention"] = "sdpa"  # pinned: the packed and unpacked plans would each time
    if arch == "llama":
        base = hf_overrides(hf_folder("llama"), seq_len=PACKED_T)
    over = {**base, "data.packing": "bfd", "memory.checkpointing": "selective"}
    cfg = load_config("tiny", overrides={**over, "train.compile": "none"})
    plan = plan_memory(cfg)
    _, measured = measure_real_step(cfg)
    assert plan.memory["peak"] == pytest.approx(measured["peak"], rel=0.05)
    saved = measured["saved_activations_per_micro_batch"]
    assert plan.saved_per_micro_batch == pytest.approx(saved, rel=1e-3)
    unpacked = plan_memory(load_config("tiny", overrides={**over, "data.packing": "none"}))
    assert plan.memory["peak"] > unpacked.memory["peak"]  # the masks are followed


def test_a_transformers_model_that_ignores_position_ids_is_refused_packed_rows(tmp_path):
    """OPT builds its positions from the attention mask: packed documents would see each
    other, so the build refuses greedy and bfd on it (one line) and keeps none."""
    import transformers
    from conftest import hf_overrides

    from onegpu.backends.torch.build import build
    from onegpu.config import load_config

    opt = transformers.OPTConfig(
        hidden_size=64, num_hidden_layers=2, ffn_dim=128, num_attention_heads=4,
        vocab_size=320, max_position_embeddings=128, word_embed_proj_dim=64, dropout=0.0,
    )  # fmt: skip
    transformers.OPTForCausalLM(opt).save_pretrained(tmp_path / "opt")
    over = hf_overrides(tmp_path / "opt", seq_len=64)
    with pytest.raises(ConfigError, match="data.packing.*OPTForCausalLM"):
        build(load_config("tiny", overrides={**over, "data.packing": "bfd"}), with_data=False)
    build(load_config("tiny", overrides={**over, "data.packing": "none"}), with_data=False)


def test_the_plan_reports_what_a_step_trains_of_the_data(tmp_path):
    from onegpu.config import load_config
    from onegpu.plan.format import format_report
    from onegpu.plan.report import plan_report

    source = str(write_jsonl(tmp_path / "pr.jsonl", arithmetic_rows(200)))
    over = {"data.source": source, "model.seq_len": str(PACKED_T), "train.device": "cpu",
            "data.cache_dir": str(tmp_path)}  # fmt: skip
    found = {}
    for packing in ("none", "bfd"):
        cfg = load_config("tiny", overrides={**over, "data.packing": packing})
        report = plan_report(cfg, None, None)
        found[packing] = report["data"]
        assert f"{report['data']['trained_tokens_per_step']:,.0f} of" in format_report(report, None)
    none, bfd = found["none"], found["bfd"]
    assert none["tokens_per_step"] == bfd["tokens_per_step"] == 8 * PACKED_T
    assert bfd["padding"] < none["padding"]
    assert bfd["trained_tokens_per_step"] > 2 * none["trained_tokens_per_step"]
    assert bfd["predicted_trained_tokens_per_s"] > 2 * none["predicted_trained_tokens_per_s"]
    assert "data" not in plan_report(load_config("tiny"), None, None)  # stdlib text: no rows


@pytest.mark.gpu
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("arch", ["gpt", "llama"])
def test_on_a_gpu_packed_rows_train_as_each_example_alone(tmp_path, hf_folder, arch, precision):
    """CUDA's SDPA takes the explicit mask on its memory-efficient kernel (our GPT) and
    transformers builds its own packed mask: each example's loss in its row is its own."""
    from conftest import hf_overrides

    from onegpu.backends.torch.build import build
    from onegpu.config import load_config
    from onegpu.models.documents import documents

    base = {"model.seq_len": str(PACKED_T), "train.precision": precision}
    if arch == "llama":
        base = {**hf_overrides(hf_folder("llama"), seq_len=PACKED_T), **base}
    cfg = load_config("tiny", overrides={**base, "train.device": "cuda", "train.compile": "none"})
    built = build(cfg, torch.device("cuda"), with_data=False)
    model = built.model.eval()
    rows = _splits(tmp_path, "bfd", PACKED_T).train_rows
    x, y, pos = (
        torch.from_numpy(np.stack(a)).cuda() for a in zip(*(rows.row(i) for i in range(4)))
    )
    tol = 1e-4 if precision == "fp32" else 2e-2
    with torch.no_grad(), built.resolved.precision.autocast(torch.device("cuda")):
        with documents(model, pos):
            packed = _logits(model, x).float()
        for r in range(4):
            at = 0
            for e in rows.packs[rows.offsets[r] : rows.offsets[r + 1]]:
                n = int(rows.spans[e][1] - rows.spans[e][0]) - 1
                alone = _logits(model, x[r : r + 1, at : at + n]).float()
                torch.testing.assert_close(
                    packed[r : r + 1, at : at + n], alone, rtol=tol, atol=tol
                )
                at += n
