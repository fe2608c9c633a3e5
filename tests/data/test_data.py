import json
from pathlib import Path

import numpy as np
import pytest
import torch

from onegpu.backends.torch.loader import PackedSequences, make_train_loader
from onegpu.config import ConfigError, DataConfig
from onegpu.data.sources import in_val, open_source
from onegpu.data.tokenizer import BPETokenizer, ByteTokenizer
from onegpu.data.tokens import prepare_tokens, read_bin, write_bin
from onegpu.data.windows import Rows


def _first_batches(tokens, seed, n=3):
    loader = make_train_loader(
        Rows(tokens, 16), batch_size=4, seed=seed, num_workers=0, pin_memory=False
    )
    it = iter(loader)
    return [next(it) for _ in range(n)]


def test_loader_order_is_deterministic_and_seeded():
    tokens = np.arange(10_000, dtype=np.uint16)
    a, b, c = _first_batches(tokens, 1), _first_batches(tokens, 1), _first_batches(tokens, 2)
    for (xa, ya), (xb, yb) in zip(a, b, strict=True):
        assert torch.equal(xa, xb) and torch.equal(ya, yb)
    assert not all(torch.equal(xa, xc) for (xa, _), (xc, _) in zip(a, c, strict=True))


def test_packed_windows_are_shifted_targets_and_cover_each_epoch_once():
    tokens = np.arange(1 + 16 * 10, dtype=np.uint16)
    data = PackedSequences(Rows(tokens, 16))
    x, y = data[3]
    assert torch.equal(y[:-1], x[1:]) and x[0] == 48
    loader = make_train_loader(
        Rows(tokens, 16), batch_size=5, seed=0, num_workers=0, pin_memory=False
    )
    it = iter(loader)
    starts = torch.cat([next(it)[0][:, 0] for _ in range(2)])  # one epoch = 10 windows
    assert sorted(starts.tolist()) == [16 * i for i in range(10)]


@pytest.mark.slow  # reads every standard-library file
def test_stdlib_split_is_deterministic_and_disjoint():
    source = open_source("stdlib", val_fraction=0.05)
    names = [n for n, _ in source._named_records()]
    assert names == sorted(names) and len(names) > 100
    assert not any("site-packages" in n for n in names)
    val = {n for n in names if in_val(n, 0.05)}
    assert 0 < len(val) < len(names) * 0.15
    train_docs = {r["text"] for _, r in source.records("train")}
    val_docs = [r["text"] for _, r in source.records("val")]
    assert len(val_docs) == len(val)
    assert not train_docs.intersection(val_docs)


def test_bin_reader_round_trips(tmp_path):
    for dtype, hi in (("uint16", 65_535), ("uint32", 100_000)):
        tokens = np.array([0, 1, 2, hi, 7], dtype=dtype)
        path = tmp_path / f"t-{dtype}.bin"
        tokens.tofile(path)  # exactly what nanoGPT's prepare.py does
        assert np.array_equal(read_bin(path, dtype), tokens)
        write_bin(path, tokens.astype(np.int64), dtype)
        assert np.array_equal(read_bin(path, dtype), tokens)


def test_nanogpt_folder_and_truncated_file(tmp_path):
    np.arange(5000, dtype=np.uint16).tofile(tmp_path / "train.bin")
    np.arange(300, dtype=np.uint16).tofile(tmp_path / "val.bin")
    splits = prepare_tokens(DataConfig(source=str(tmp_path)), model_vocab=8192)
    assert len(splits.train) == 5000 and len(splits.val) == 300
    with pytest.raises(ConfigError, match="model.vocab_size"):
        prepare_tokens(DataConfig(source=str(tmp_path)), model_vocab=1000)
    (tmp_path / "bad.bin").write_bytes(b"\x01\x02\x03")
    with pytest.raises(ConfigError, match="not a whole number"):
        prepare_tokens(DataConfig(source=str(tmp_path / "bad.bin")), model_vocab=8192)


def test_text_jsonl_and_folder_sources(tmp_path):
    text = "".join(f"line {i}: the quick brown fox\n" for i in range(2000))
    (tmp_path / "a.txt").write_text(text)
    cache = str(tmp_path / "cache")
    s = prepare_tokens(
        DataConfig(source=str(tmp_path / "a.txt"), cache_dir=cache, val_fraction=0.1), 256
    )
    assert abs(len(s.val) / (len(s.train) + len(s.val)) - 0.1) < 0.01
    decoded = ByteTokenizer().decode(np.concatenate([s.train, s.val]))
    assert decoded == text  # the split loses and duplicates nothing

    with open(tmp_path / "d.jsonl", "w") as f:
        for i in range(200):
            f.write(json.dumps({"body": f"document {i} " * 20}) + "\n")
    s = prepare_tokens(
        DataConfig(source=str(tmp_path / "d.jsonl"), text_field="body", cache_dir=cache), 256
    )
    assert len(s.train) > 0 and len(s.val) > 0
    with pytest.raises(ConfigError, match="data.text_field"):
        prepare_tokens(DataConfig(source=str(tmp_path / "d.jsonl"), cache_dir=cache), 256)

    folder = tmp_path / "docs"
    folder.mkdir()
    for i in range(50):
        (folder / f"{i:02d}.md").write_text(f"# doc {i}\n" * 30)
    s = prepare_tokens(DataConfig(source=str(folder), cache_dir=cache, val_fraction=0.2), 256)
    assert len(s.train) > len(s.val) > 0
    with pytest.raises(ConfigError, match="data.source"):
        prepare_tokens(DataConfig(source=str(tmp_path / "missing.txt"), cache_dir=cache), 256)


def test_bpe_trains_locally_round_trips_and_caches(tmp_path):
    folder = tmp_path / "docs"
    folder.mkdir()
    for i in range(40):
        (folder / f"{i}.txt").write_text(
            f"def function_{i}(x):\n    return x * {i} + offset\n" * 20
        )
    data = DataConfig(
        source=str(folder), tokenizer="bpe", tokenizer_vocab=300, cache_dir=str(tmp_path / "c")
    )
    s = prepare_tokens(data, model_vocab=320)
    assert isinstance(s.tokenizer, BPETokenizer)
    assert int(s.train.max()) < 300
    text = "def function_3(x):\n    return x * 3 + offset\n"
    assert s.tokenizer.decode(s.tokenizer.encode(text)) == text
    assert len(s.tokenizer.encode(text)) < len(text.encode()) / 2  # merges were learned
    assert len(list((tmp_path / "c" / "tokenizers").iterdir())) == 1


def test_corrupt_or_half_made_caches_are_rebuilt(tmp_path):
    import os
    import subprocess

    from onegpu.data.tokens import cache_root

    text = tmp_path / "corpus.txt"
    text.write_text("the quick brown fox jumps over the lazy dog\n" * 400)
    data = DataConfig(source=str(text), cache_dir=str(tmp_path / "cache"))
    first = np.array(prepare_tokens(data, 256).train)  # a copy: the file is about to be cut
    folder = next((cache_root(data.cache_dir) / "tokens").iterdir())
    # a tokenization killed mid-way (its process is gone) left its temporary folder
    dead = subprocess.Popen(["true"])
    dead.wait()
    stale = folder.with_name(f"{folder.name}.tmp{dead.pid}")
    stale.mkdir()
    (folder / "train.bin").write_bytes(b"\x01\x00" * 3)  # truncated: fewer tokens than counted
    again = prepare_tokens(data, 256)
    assert not stale.exists()
    assert np.array_equal(np.asarray(again.train), first)
    assert os.listdir(folder.parent) == [folder.name]


def test_a_corrupt_cached_tokenizer_is_trained_again(tmp_path):
    from onegpu.data.tokens import cache_root

    text = tmp_path / "corpus.txt"
    text.write_text("".join(f"line {i} of some text to learn merges from\n" for i in range(3000)))
    data = DataConfig(source=str(text), cache_dir=str(tmp_path / "cache"), tokenizer="bpe",
                      tokenizer_vocab=300)  # fmt: skip
    first = np.array(prepare_tokens(data, 300).train)
    tok_file = next((cache_root(data.cache_dir) / "tokenizers").iterdir())
    tok_file.write_text("{ not json")
    (cache_root(data.cache_dir) / "tokens").rename(tmp_path / "old-tokens")  # tokenize again
    again = prepare_tokens(data, 300)
    assert np.array_equal(np.asarray(again.train), first)


def test_a_warmup_longer_than_the_run_warns_in_one_line(capsys):
    from onegpu.cli import main

    code = main(["plan", "--preset", "tiny", "--train.max_steps", "5", "--optim.warmup_steps",
                 "50", "--json"])  # fmt: skip
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 0 and err == [
        "onegpu: warning: optim.warmup_steps=50 is longer than the run (train.max_steps=5): "
        "the learning rate never reaches optim.lr"
    ]


def test_a_folder_lists_its_text_files_sorted_and_never_walks_what_it_skips(tmp_path, monkeypatch):
    """The listing (whose order the token cache's fingerprint follows) keeps text files, drops
    dot-files and dot-folders, and for the standard library its tests and site-packages: those
    folders are pruned, not walked (a site-packages of ~90,000 entries took 6 s to list)."""
    import os

    from onegpu.data import sources

    files = ["b.py", "a/z.txt", "a/y.md", "a/.hidden.py", ".git/c.py", "tests/t.py",
             "site-packages/torch/big.py", "a/__pycache__/m.py", "a/b/README", "a/notes.bin"]  # fmt: skip
    for name in files:
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text("x")
    walked = []
    real_walk = os.walk

    def recording_walk(top, *args, **kwargs):
        for folder, dirs, names in real_walk(top, *args, **kwargs):
            walked.append(Path(folder).relative_to(tmp_path).as_posix())
            yield folder, dirs, names

    monkeypatch.setattr(sources.os, "walk", recording_walk)
    rel = lambda paths: [p.relative_to(tmp_path).as_posix() for p in paths]  # noqa: E731
    assert rel(sources._list_text_files(tmp_path, "folder")) == [
        "a/__pycache__/m.py", "a/b/README", "a/y.md", "a/z.txt", "b.py",
        "site-packages/torch/big.py", "tests/t.py",
    ]  # fmt: skip
    assert "a/b" in walked and ".git" not in walked  # walked, and pruned
    walked.clear()
    assert rel(sources._list_text_files(tmp_path, "stdlib")) == ["b.py"]
    assert "a" in walked
    assert not {"site-packages", "site-packages/torch", "tests", "a/__pycache__"} & set(walked)
