"""Instruction and chat data: every container of the same records gives the same token cache,
prompts and user turns carry no loss, a chat renders as the model's own template does, and the
step's loss over masked targets is the hand-computed one."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from instruction_sets import (
    CHATML,
    arithmetic_rows,
    chat_rows,
    chatml_tokenizer_folder,
    write_jsonl,
)

from onegpu.config import ConfigError, DataConfig
from onegpu.data.chat import DEFAULT_TEMPLATE, default_template
from onegpu.data.tokenizer import ByteTokenizer, FileTokenizer
from onegpu.data.tokens import prepare_tokens
from onegpu.data.windows import IGNORE_INDEX


def _containers(tmp_path, rows: list[dict]) -> dict[str, str]:
    """The same rows as JSONL, a JSON array, a Parquet file, a folder of two Parquet files,
    a saved Dataset and a saved DatasetDict's split."""
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    write_jsonl(tmp_path / "rows.jsonl", rows)
    (tmp_path / "rows.json").write_text(json.dumps(rows, indent=1))
    table = pa.Table.from_pylist(rows)
    pq.write_table(table, tmp_path / "rows.parquet", row_group_size=17)
    (tmp_path / "parts").mkdir()
    half = len(rows) // 2
    pq.write_table(table.slice(0, half), tmp_path / "parts" / "part-0.parquet")
    pq.write_table(table.slice(half), tmp_path / "parts" / "part-1.parquet")
    saved = datasets.Dataset.from_list(rows)
    saved.save_to_disk(str(tmp_path / "saved"))
    datasets.DatasetDict({"train": saved, "test": saved.select(range(3))}).save_to_disk(
        str(tmp_path / "saved-dict")
    )
    return {
        name: str(tmp_path / rel)
        for name, rel in {
            "jsonl": "rows.jsonl",
            "json": "rows.json",
            "parquet": "rows.parquet",
            "parquet-folder": "parts",
            "save_to_disk": "saved",
            "DatasetDict": "saved-dict",
        }.items()
    }


@pytest.mark.parametrize("rows", [arithmetic_rows(120), chat_rows(60)], ids=["pr", "chat"])
def test_every_container_of_the_same_records_gives_the_same_token_cache(tmp_path, rows):
    cache = str(tmp_path / "cache")
    made = {
        name: prepare_tokens(DataConfig(source=path, cache_dir=cache, val_fraction=0.2), 256)
        for name, path in _containers(tmp_path, rows).items()
    }
    first = made["jsonl"]
    assert first.counts["val"]["examples"] > 0 and first.train_mask is not None
    for name, splits in made.items():
        for a, b in ((splits.train, first.train), (splits.val, first.val)):
            assert np.array_equal(a, b), name
        assert np.array_equal(splits.train_mask, first.train_mask), name
        assert splits.counts == first.counts and splits.fingerprint() == first.fingerprint()


def test_the_answer_and_its_end_are_trained_the_prompt_is_not(tmp_path):
    rows = arithmetic_rows(50)
    source = str(write_jsonl(tmp_path / "pr.jsonl", rows))
    s = prepare_tokens(DataConfig(source=source, cache_dir=str(tmp_path), val_fraction=0), 256)
    byte = ByteTokenizer()
    trained = s.train[s.train_mask == 1]
    # each answer, then the end-of-text token that closes its example
    want = b"".join(r["response"].encode() + b"\x00" for r in rows)
    assert bytes(trained.astype(np.uint8)) == want
    assert byte.decode(s.train) == "".join(r["prompt"] + r["response"] for r in rows)
    assert s.counts["train"] == {"examples": 50, "tokens": len(s.train), "trained": len(want)}
    everything = DataConfig(
        source=source, cache_dir=str(tmp_path), val_fraction=0, train_on="prompt+response"
    )
    assert prepare_tokens(everything, 256).train_mask.all()


def test_alpaca_records_and_templates_fill_the_prompt(tmp_path):
    rows = [
        {"instruction": "Add the numbers.", "input": "2 and 3", "output": "5"},
        {"instruction": "Say hi.", "input": "", "output": "hi"},
    ]
    source = str(write_jsonl(tmp_path / "alpaca.jsonl", rows))
    s = prepare_tokens(DataConfig(source=source, cache_dir=str(tmp_path), val_fraction=0), 256)
    text = ByteTokenizer().decode(s.train)
    assert "### Input:\n2 and 3\n\n### Response:\n5" in text
    assert "### Instruction:\nSay hi.\n\n### Response:\nhi" in text and "### Input:\n\n" not in text
    templated = DataConfig(
        source=source,
        cache_dir=str(tmp_path),
        val_fraction=0,
        template="Q: {instruction} {input}\nA: ",
    )
    assert (
        ByteTokenizer()
        .decode(prepare_tokens(templated, 256).train)
        .startswith("Q: Add the numbers. 2 and 3\nA: 5")
    )


def test_a_chat_renders_as_apply_chat_template_token_for_token(tmp_path):
    """Through a model folder's tokenizer: each conversation's tokens equal transformers'
    `apply_chat_template`; the trained ones are the assistant turns with their end tokens."""
    from transformers import AutoTokenizer

    rows = chat_rows(30)
    texts = [m["content"] for r in rows for m in r["messages"]]
    folder = chatml_tokenizer_folder(tmp_path / "model", texts)
    hf = AutoTokenizer.from_pretrained(str(folder))
    eos = hf.convert_tokens_to_ids("<|im_end|>")
    tok = FileTokenizer(folder / "tokenizer.json", eos)
    source = str(write_jsonl(tmp_path / "chat.jsonl", rows))
    s = prepare_tokens(DataConfig(source=source, cache_dir=str(tmp_path), val_fraction=0), 400, tok)
    want = [hf.apply_chat_template(r["messages"], tokenize=True)["input_ids"] for r in rows]
    # ChatML ends each turn with <|im_end|>\n: the end-of-text token closes each example
    assert s.train.tolist() == [t for ids in want for t in [*ids, eos]]
    trained = hf.decode(s.train[s.train_mask == 1].tolist())
    answers = [m["content"] for r in rows for m in r["messages"] if m["role"] == "assistant"]
    assert trained == "".join(
        a + "<|im_end|>\n" + ("<|im_end|>" if i % 2 else "") for i, a in enumerate(answers)
    )


def test_the_default_chat_template_and_last_turn_training(tmp_path):
    rows = chat_rows(5)
    source = str(write_jsonl(tmp_path / "chat.jsonl", rows))
    base = {"source": source, "cache_dir": str(tmp_path), "val_fraction": 0}
    s = prepare_tokens(DataConfig(**base), 256)
    first = rows[0]["messages"]
    text = "".join(f"<|{m['role']}|>\n{m['content']}\n" for m in first)
    assert default_template().render(first, False) == text and "<|" in DEFAULT_TEMPLATE
    assert ByteTokenizer().decode(s.train).startswith(text)
    last = prepare_tokens(DataConfig(**base, train_on="response"), 256)
    answers = b"".join(r["messages"][-1]["content"].encode() + b"\n\x00" for r in rows)
    assert bytes(last.train[last.train_mask == 1].astype(np.uint8)) == answers


def test_masked_loss_equals_the_hand_computed_one_over_uneven_micro_batches(tmp_path, tiny_cfg):
    """The loader's targets and the step: the loss is the mean negative log-likelihood of the
    answer tokens alone (log-probabilities computed here from the model's logits), and
    accumulating 4 micro-batches of very different trained counts gives its gradient."""
    from conftest import accumulate

    from onegpu.backends.torch.loader import PackedSequences
    from onegpu.models.gpt import GPT

    rows = arithmetic_rows(40)
    for r in rows[:6]:  # long answers first: the first micro-batches train many more tokens
        r["response"] = f"The sum is {r['response']} " * 4
    source = str(write_jsonl(tmp_path / "pr.jsonl", rows))
    s = prepare_tokens(DataConfig(source=source, cache_dir=str(tmp_path), val_fraction=0), 256)
    T = 32
    data = PackedSequences(s.cut(DataConfig(packing="stream"), T).train_rows)
    x, y = (torch.stack(t) for t in zip(*(data[i] for i in range(8)), strict=True))
    counts = (y != IGNORE_INDEX).sum(1).view(4, 2).sum(1)
    assert counts.max() > 1.5 * counts.min() > 0  # uneven micro-batches
    torch.manual_seed(0)
    model = GPT(tiny_cfg.model).double()
    model.init_weights()
    targets = torch.from_numpy(s.train[1 : 8 * T + 1].astype(np.int64)).view(8, T)
    trained = torch.from_numpy(s.train_mask[1 : 8 * T + 1].astype(bool)).view(8, T)
    logp = torch.log_softmax(model(x), dim=-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    reference = -logp[trained].mean()
    reference.backward()
    want = [p.grad.clone() for p in model.parameters()]
    loss = accumulate(model, x, y, n_micro=4)
    grads = [p.grad for p in model.parameters()]
    torch.testing.assert_close(loss, reference.detach(), rtol=1e-12, atol=0)
    for a, b in zip(grads, want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-14)


@pytest.mark.parametrize(
    ("rows", "over", "field", "words"),
    [
        (
            [{"question": "q", "response": "a"}],
            {"format": "prompt-response"},
            "data.prompt_field",
            "record-1",
        ),
        (
            [{"prompt": "q", "response": "a"}, {"prompt": "q", "response": " "}],
            {},
            "data.response_field",
            "record-2",
        ),
        (
            [{"messages": [{"role": "narrator", "content": "x"}]}],
            {},
            "data.messages_field",
            "message 0 has role 'narrator'",
        ),
        (
            [{"messages": [{"role": "user", "content": "x"}]}],
            {},
            "data.messages_field",
            "no assistant turn",
        ),
        (
            [{"instruction": "i", "output": "o"}],
            {"template": "{nope}\n"},
            "data.template",
            "'nope'",
        ),
        ([{"prompt": "q", "response": "a"}], {"train_on": "assistant"}, "data.train_on", "chat"),
    ],
    ids=[
        "missing-field",
        "empty-response",
        "unknown-role",
        "no-assistant",
        "template-field",
        "train-on",
    ],
)
def test_a_bad_record_is_named_and_nothing_is_cached(tmp_path, rows, over, field, words):
    source = str(write_jsonl(tmp_path / "bad.jsonl", rows))
    cache = tmp_path / "cache"
    with pytest.raises(ConfigError, match=field) as e:
        prepare_tokens(DataConfig(source=source, cache_dir=str(cache), val_fraction=0, **over), 256)
    assert words in str(e.value) and "\n" not in str(e.value)
    assert not (cache / "tokens").exists() or not any((cache / "tokens").iterdir())


def test_a_corrupt_parquet_file_and_a_missing_split_are_named(tmp_path):
    import datasets

    (tmp_path / "bad.parquet").write_bytes(b"PAR1 not really parquet PAR1")
    with pytest.raises(ConfigError, match="data.source.*not a readable Parquet"):
        prepare_tokens(
            DataConfig(source=str(tmp_path / "bad.parquet"), cache_dir=str(tmp_path)), 256
        )
    saved = datasets.Dataset.from_list(arithmetic_rows(4))
    datasets.DatasetDict({"train": saved}).save_to_disk(str(tmp_path / "dict"))
    with pytest.raises(ConfigError, match="data.split.*'validation'.*train"):
        prepare_tokens(
            DataConfig(source=str(tmp_path / "dict"), split="validation", cache_dir=str(tmp_path)),
            256,
        )


def test_a_chat_fine_tune_keeps_its_template_through_export_and_generate(tmp_path, capsys):
    """Train a model folder on chat records, export, `generate --chat`: the run folder and
    the export carry the template the data was rendered with, and the chat prompt is that
    template's generation prompt."""
    import transformers
    from conftest import make_hf_config

    from onegpu.cli import main
    from onegpu.data.chat import template_of
    from onegpu.tools.trained import load_trained

    rows = chat_rows(40)
    folder = chatml_tokenizer_folder(
        tmp_path / "model", [m["content"] for r in rows for m in r["messages"]]
    )
    config = make_hf_config("qwen2")
    config.vocab_size, config.eos_token_id = 448, 2  # <|im_end|> ends an answer
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    data = write_jsonl(tmp_path / "chat.jsonl", rows)
    run, out = tmp_path / "run", tmp_path / "hf"
    common = ["--train.device", "cpu", "--out.progress", "false", "--train.precision", "fp32"]
    train = ["train", "--model.hf", str(folder), "--data.source", str(data), "--out", str(run)]
    assert main([*train, "--model.seq_len", "64", "--train.max_steps", "2", *common]) == 0
    assert (run / "chat_template.jinja").read_text() == CHATML
    data = json.loads((run / "summary.json").read_text())["data"]
    assert data["packing"] == "none" and data["examples"] == data["counts"]["train"]["examples"]
    assert main(["export", str(run), "--out", str(out)]) == 0
    assert (
        template_of(out).render(rows[0]["messages"][:2], True).endswith("<|im_start|>assistant\n")
    )
    capsys.readouterr()
    argv = ["generate", str(out), "--chat", "--prompt", "1 + 2?", "--max-new-tokens", "3"]
    assert main([*argv, "--temperature", "0"]) == 0
    answer = capsys.readouterr().out
    assert "<|im_start|>" not in answer  # the answer alone, not the rendered prompt
    assert load_trained(str(out)).tokenizer.eot_id == 2


@pytest.mark.parametrize("window", [1, 7, 64, 1 << 20])
def test_a_json_array_streams_record_by_record_across_any_window(tmp_path, window):
    """The array is decoded one element at a time from a window of the file: whatever the
    window, the elements are json.loads' (strings with brackets and commas, nesting, numbers
    cut at a window's edge, unicode)."""
    from onegpu.data.sources import _json_array_items

    rows = [{"prompt": "a, [b]", "response": "}{ ", "n": 12345678901234},
            {"messages": [{"role": "user", "content": "ünï ☃"}]}, 3.25, [1, [2, 3]], "x"]  # fmt: skip
    path = tmp_path / "rows.json"
    path.write_text(json.dumps(rows, indent=2, ensure_ascii=False), encoding="utf-8")
    assert list(_json_array_items(path, window)) == rows
    (tmp_path / "empty.json").write_text(" [ ] ")
    assert list(_json_array_items(tmp_path / "empty.json", window)) == []
    (tmp_path / "cut.json").write_text('[{"a": 1}, {"b": ')
    with pytest.raises(json.JSONDecodeError):
        list(_json_array_items(tmp_path / "cut.json", window))
