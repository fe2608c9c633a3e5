"""Every bad input ends the same way: one line naming the field (or file) and a fix, exit code 2,
no traceback, and nothing already written is touched (a watched run folder and data file are
compared byte for byte after every case)."""

import hashlib
import os
from pathlib import Path

import pytest

from onegpu.cli import main


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """A run folder holding a finished run, a data file, and files that are wrong as inputs."""
    root = tmp_path_factory.mktemp("bad-input")
    run = root / "old-run"
    (run / "checkpoints").mkdir(parents=True)
    (run / "metrics.jsonl").write_text('{"step": 1, "loss": 5.0}\n')
    (run / "summary.json").write_text('{"steps": 1}\n')
    (run / "checkpoints" / "step-00000001.pt").write_bytes(b"PK\x03\x04 not really")
    data = root / "data.txt"
    data.write_text("hello world\n" * 2000)
    (root / "empty-dir").mkdir()
    (root / "binary.txt").write_bytes(bytes(range(256)) * 64)
    (root / "bad.toml").write_text("[train\nmax_steps = 3\n")
    (root / "wrong-type.toml").write_text('[train]\nbatch_size = "big"\n')
    (root / "not-a-table.toml").write_text("train = 3\n")
    (root / "a-file").write_text("x")
    (root / "garbage.pt").write_bytes(os.urandom(1000))
    (root / "not-utf8.txt").write_bytes(b"caf\xe9 " * 1000)
    (root / "preset-number.toml").write_text("preset = 3\n")
    (root / "top-level.toml").write_text("max_steps = 3\n")
    (root / "array.json").write_text('["a", "b"]\n')
    (root / "chat-narrator.jsonl").write_text(
        '{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}\n'
        '{"messages": [{"role": "narrator", "content": "x"}]}\n'
    )
    (root / "corrupt.parquet").write_bytes(b"PAR1 not really parquet PAR1")
    _dataset_dict(root / "dataset-dict")
    (root / "binary-folder").mkdir()
    (root / "binary-folder" / "blob").write_bytes(bytes(range(256)) * 64)
    _hf_folders(root)
    return root


def _dataset_dict(path: Path) -> None:
    import datasets

    rows = [{"prompt": f"{i} + 1 = ", "response": str(i + 1)} for i in range(20)]
    datasets.DatasetDict({"train": datasets.Dataset.from_list(rows)}).save_to_disk(str(path))


def _hf_folders(root: Path) -> None:
    """Model folders: a tiny Llama (config only), a Gemma-2 with soft-capped logits, a BERT
    classifier, a malformed config.json, and pickled weights only."""
    import transformers
    from conftest import make_hf_config

    make_hf_config("llama").save_pretrained(root / "hf-llama")
    make_hf_config("bert").save_pretrained(root / "hf-bert")
    transformers.Gemma2Config(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, vocab_size=320, final_logit_softcapping=30.0,
    ).save_pretrained(root / "hf-gemma2")  # fmt: skip
    (root / "hf-bad").mkdir()
    (root / "hf-bad" / "config.json").write_text("{not json")
    make_hf_config("gpt2").save_pretrained(root / "hf-pickled")
    (root / "hf-pickled" / "pytorch_model.bin").write_bytes(b"pickle")
    import json

    make_hf_config("llama").save_pretrained(root / "hf-no-width")
    raw = json.loads((root / "hf-no-width" / "config.json").read_text())
    del raw["hidden_size"]
    (root / "hf-no-width" / "config.json").write_text(json.dumps(raw))


def W(root: Path) -> dict[str, str]:
    """Paths used in the cases, keyed by name."""
    return {k: str(root / v) for k, v in {
        "run": "old-run", "data": "data.txt", "empty": "empty-dir", "binary": "binary.txt",
"bad": "bad.toml", "wrong": "wrong-type.toml",
        "table": "not-a-table.toml", "file": "a-file", "garbage": "garbage.pt",
        "latin1": "not-utf8.txt", "new": "new-run", "llama": "hf-llama", "bert": "hf-bert",
        "gemma2": "hf-gemma2", "hfbad": "hf-bad", "pickled": "hf-pickled",
        "preset3": "preset-number.toml", "toplevel": "top-level.toml", "array": "array.json",
        "nowidth": "hf-no-width", "binfolder": "binary-folder", "narrator": "chat-narrator.jsonl",
        "parquet": "corrupt.parquet", "dsdict": "dataset-dict",
    }.items()}  # fmt: skip


T = ["train", "--preset", "tiny", "--train.device", "cpu", "--out.progress", "false",
     "--train.max_steps", "2", "--optim.warmup_steps", "0", "--out", "{new}/t"]  # fmt: skip
CASES = [  # (name, argv with {placeholders}, the field the message must name)
    ("zero layers", T + ["--model.n_layer", "0"], "model.n_layer"),
    ("heads not dividing width", T + ["--model.n_head", "3"], "model.d_model"),
    ("batch not divisible", T + ["--train.batch_size", "10", "--train.micro_batch_size", "4"], "train.batch_size"),
    ("unknown precision", T + ["--train.precision", "fp8"], "train.precision"),
    ("unknown checkpointing", T + ["--memory.checkpointing", "blocks"], "memory.checkpointing"),
    ("every:0", T + ["--memory.checkpointing", "every:0"], "memory.checkpointing"),
    ("unknown optimizer", T + ["--optim.name", "adam"], "optim.name"),
    ("negative lr", T + ["--optim.lr", "-1"], "optim.lr"),
    ("infinite lr", T + ["--optim.lr", "inf"], "optim.lr"),
    ("nan lr", T + ["--optim.lr", "nan"], "optim.lr"),
    ("zero eps", T + ["--optim.eps", "0"], "optim.eps"),
    ("beta2 of 1", T + ["--optim.beta2", "1.0"], "optim.beta2"),
    ("negative init std", T + ["--model.init_std", "-0.1"], "model.init_std"),
    ("negative seed", T + ["--train.seed", "-1"], "train.seed"),
    ("huge seed", T + ["--train.seed", str(2**70)], "train.seed"),
    ("num_workers below -1", T + ["--data.num_workers", "-2"], "data.num_workers"),
    ("dropout of 1", T + ["--model.dropout", "1.0"], "model.dropout"),
    ("val fraction over 1", T + ["--data.val_fraction", "1.5"], "data.val_fraction"),
    ("seq_len over the context", T + ["--data.seq_len", "100000"], "data.seq_len"),
    ("no cuda", T + ["--train.device", "cuda"], "train.device"),
    ("unknown device", T + ["--train.device", "tpu"], "train.device"),
    ("vocab below bytes", T + ["--model.vocab_size", "100"], "model.vocab_size"),
    ("bpe vocab too small", T + ["--data.tokenizer", "bpe", "--data.tokenizer_vocab", "100"], "data.tokenizer_vocab"),
    ("adafactor with bf16-pure", T + ["--train.precision", "bf16-pure", "--optim.name", "adafactor"], "optim.name"),
    ("in-backward with clipping", T + ["--optim.in_backward", "true"], "optim.grad_clip"),
    ("weight offload with DDP", T + ["--memory.offload_params", "true", "--dist.strategy", "ddp"], "memory.offload_params"),
    ("plan: host memory of 0", ["plan", "--preset", "tiny", "--host-memory", "0"], "--host-memory"),
    ("keep_last 0", T + ["--checkpoint.keep_last", "0"], "checkpoint.keep_last"),
    ("negative checkpoint.every", T + ["--checkpoint.every", "-1"], "checkpoint.every"),
    ("not an integer", T + ["--train.max_steps", "abc"], "train.max_steps"),
    ("not a boolean", T + ["--out.overwrite", "yes"], "out.overwrite"),
    ("unknown option", T + ["--train.max_step", "3"], "train.max_step"),
    ("unknown preset", ["train", "--preset", "gpt5"], "--preset"),
    ("missing config file", T + ["--config", "{new}/missing.toml"], "--config"),
    ("config is a folder", T + ["--config", "{empty}"], "--config"),
    ("config not TOML", T + ["--config", "{bad}"], "--config"),
    ("config value of the wrong type", T + ["--config", "{wrong}"], "train.batch_size"),
    ("config section not a table", T + ["--config", "{table}"], "train"),
    ("missing data", T + ["--data.source", "{new}/nothing.txt", "--out", "{new}/a"], "data.source"),
    ("data folder without text", T + ["--data.source", "{empty}", "--out", "{new}/b"], "data.source"),
    ("binary data", T + ["--data.source", "{binary}", "--out", "{new}/c"], "data.source"),
    ("data not UTF-8", T + ["--data.source", "{latin1}", "--out", "{new}/d"], "data.source"),
    ("out holds a run", T + ["--out", "{run}"], "out.dir"),
    ("out is a file", T + ["--out", "{file}"], "out.dir"),
    ("out not writable", T + ["--out", "/proc/onegpu-run"], "out.dir"),
    ("cache not writable", T + ["--data.cache_dir", "/proc/onegpu-cache", "--out", "{new}/e"], "data.cache_dir"),
    ("resume from a missing file", T + ["--train.resume", "{new}/none.pt", "--out", "{new}/f"], "train.resume"),
    ("resume from garbage", T + ["--train.resume", "{garbage}", "--out", "{new}/g"], "train.resume"),
    ("resume from a foreign file", T + ["--train.resume", "{data}", "--out", "{new}/h"], "train.resume"),
    ("plan: unknown GPU", ["plan", "--preset", "tiny", "--gpu", "A100-41"], "--gpu"),
    ("plan: negative budget", ["plan", "--preset", "tiny", "--memory", "-5"], "--memory"),
    ("plan: --memory above the GPU", ["plan", "--preset", "tiny", "--gpu", "RTX4090", "--memory", str(30 * 2**30)], "--memory"),
    ("plan: --gpu and --memory on a mesh", ["plan", "--preset", "tiny", "--gpu", "RTX4090", "--memory", "1000", "--world-size", "2"], "keep --gpu RTX4090"),
    ("plan: zero host cores", ["plan", "--preset", "tiny", "--gpu", "RTX4090", "--host-cpus", "0"], "--host-cpus"),
    ("states on the host with the host optimizer", T + ["--memory.offload_states", "true", "--memory.offload_optimizer", "true"], "memory.offload_states"),
    ("plan --largest: --gpu and --memory", ["plan", "--preset", "tiny", "--largest", "--gpu", "RTX4090", "--memory", "1000"], "--memory"),
    ("tune: --gpu and --memory", ["tune", "--preset", "tiny", "--gpu", "RTX4090", "--memory", "1000", "--out", "{new}/u"], "--memory"),
    ("profile: zero steps", ["profile", "--preset", "tiny", "--steps", "0", "--out", "{new}/p"], "--steps"),
    ("bench: zero repeats", ["bench", "--preset", "tiny", "--repeats", "0", "--out", "{new}/q"], "--repeats"),
    ("bench: unknown grid", ["bench", "--grid", "nope", "--out", "{new}/r"], "--grid"),
    ("tune on a CPU without a budget", ["tune", "--preset", "tiny", "--train.device", "cpu"], "--memory"),
    ("hf: not a folder", T + ["--model.hf", "{new}/nope"], "model.hf"),
    ("hf: no config.json", T + ["--model.hf", "{empty}"], "model.hf"),
    ("hf: malformed config.json", T + ["--model.hf", "{hfbad}"], "model.hf"),
    ("hf: pickled weights only", T + ["--model.hf", "{pickled}"], "model.hf"),
    ("hf: a field the folder fixes", T + ["--model.hf", "{llama}", "--model.n_layer", "3"], "model.n_layer"),
    ("hf: seq_len over its positions", T + ["--model.hf", "{llama}", "--model.seq_len", "4096"], "model.seq_len"),
    ("hf: few-bit GELU on SwiGLU", T + ["--model.hf", "{llama}", "--memory.gelu_bits", "2"], "memory.gelu_bits"),
    ("hf: chunked loss on soft-capped logits", T + ["--model.hf", "{gemma2}", "--memory.loss_chunk", "64"], "memory.loss_chunk"),
    ("hf: SDPA where the model has none", T + ["--model.hf", "{gemma2}", "--model.attention", "sdpa"], "model.attention"),
    ("hf: chunked loss on a classifier", T + ["--model.hf", "{bert}", "--memory.loss_chunk", "64"], "memory.loss_chunk"),
    ("hf: mlp checkpointing on BERT", T + ["--model.hf", "{bert}", "--memory.checkpointing", "mlp"], "memory.checkpointing"),
    ("export: not a run", ["export", "{empty}", "--out", "{new}/x"], "RUN_DIR"),
    ("export: no --out", ["export", "{run}"], "command line"),
    ("generate: negative temperature", ["generate", "{llama}", "--temperature", "-1"], "--temperature"),
    ("generate: no tokenizer", ["generate", "{llama}", "--prompt", "hi"], "RUN_DIR"),
    ("plot: not a run", ["plot", "{empty}", "--out", "{new}/l.png"], "RUN_DIR"),
    ("no command", [], "command"),
    ("missing option value", ["train", "--preset"], "--preset"),
    ("unknown command", ["trian"], "command"),
    ("preset = 3 in a file", ["train", "--config", "{preset3}"], "preset"),
    ("a setting outside its section", ["train", "--config", "{toplevel}"], "[train]"),
    ("a JSON array as data", T + ["--data.source", "{array}"], "data.source"),
    ("a folder of binary files", T + ["--data.source", "{binfolder}"], "data.source"),
    ("hf: config.json without hidden_size", T + ["--model.hf", "{nowidth}"], "hidden_size"),
    ("chat: a message with an unknown role", T + ["--data.source", "{narrator}", "--data.val_fraction", "0"], "data.messages_field"),
    ("a corrupt Parquet file", T + ["--data.source", "{parquet}"], "data.source"),
    ("a DatasetDict without the split", T + ["--data.source", "{dsdict}", "--data.split", "validation"], "data.split"),
    ("a template that does not parse", T + ["--data.template", "{{prompt"], "data.template"),
    ("max_len longer than the row", T + ["--data.max_len", "1000"], "data.max_len"),
    ("packed rows on the flash kernel", T + ["--model.attention", "flash", "--data.packing", "greedy"], "model.attention"),
    ("blocked attention in fp16", T + ["--model.attention", "blocked", "--train.precision", "fp16"], "model.attention"),
    ("blocked attention with dropout", T + ["--model.attention", "blocked", "--model.dropout", "0.1"], "model.attention"),
    ("hf: blocked attention", T + ["--model.hf", "{llama}", "--model.attention", "blocked"], "model.attention"),
    ("jax: blocked attention", T + ["--train.backend", "jax", "--model.attention", "blocked"], "model.attention"),
    ("compiled loss kernels with the plain loss", T + ["--memory.loss_chunk", "0", "--train.loss_kernel", "compiled"], "train.loss_kernel"),
    ("compiled loss kernels on a split vocabulary", ["plan", "--preset", "tiny", "--world-size", "2", "--dist.tp", "2", "--train.loss_kernel", "compiled"], "train.loss_kernel"),
    ("compiled loss kernels on a biased head", T + ["--model.bias", "true", "--model.tie_embeddings", "false", "--memory.loss_chunk", "64", "--train.loss_kernel", "compiled"], "train.loss_kernel"),
    ("jax: the torch loss kernels", T + ["--train.backend", "jax", "--train.loss_kernel", "eager"], "train.loss_kernel"),
    ("a compiled GELU kernel with few-bit GELU", T + ["--memory.gelu_bits", "2", "--train.gelu_kernel", "compiled"], "train.gelu_kernel"),
    ("hf: a compiled GELU kernel", T + ["--model.hf", "{llama}", "--train.gelu_kernel", "compiled"], "train.gelu_kernel"),
    ("jax: the torch GELU kernel", T + ["--train.backend", "jax", "--train.gelu_kernel", "eager"], "train.gelu_kernel"),
    ("XLA flags on the torch backend", T + ["--train.xla_flags", "onednn"], "train.xla_flags"),
    ("jax: xla_flags neither a setting nor flags", T + ["--train.backend", "jax", "--train.xla_flags", "fast"], "train.xla_flags"),
    ("jax: a flag XLA does not know", T + ["--train.backend", "jax", "--train.xla_flags=--xla_cpu_no_such_flag=true"], "train.xla_flags: Unknown flag"),
    ("an over-long example under overlong error", T + ["--data.source", "{dsdict}", "--data.max_len", "8", "--data.overlong", "error"], "data.overlong"),
    ("packed rows under pipeline parallelism", ["plan", "--preset", "tiny", "--world-size", "2", "--dist.pp", "2", "--model.tie_embeddings", "false", "--data.packing", "bfd"], "data.packing"),
    ("train_on assistant for prompt-response", T + ["--data.source", "{dsdict}", "--data.train_on", "assistant"], "data.train_on"),
]  # fmt: skip


def _digest(root: Path) -> dict[str, str]:
    files = sorted(p for p in root.rglob("*") if p.is_file())
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest() for p in files}


# Cases whose twins run in the default suite: kept for the slow suite (the default stays < 5 min)
SLOW = {"hf: SDPA where the model has none", "hf: mlp checkpointing on BERT",
        "hf: chunked loss on a classifier", "hf: pickled weights only", "export: no --out",
        "generate: no tokenizer"}  # fmt: skip


@pytest.mark.parametrize(
    ("name", "argv", "field"),
    [c if c[0] not in SLOW else pytest.param(*c, marks=pytest.mark.slow) for c in CASES],
    ids=[c[0] for c in CASES],
)
def test_bad_input_is_one_clear_line_and_exit_2(name, argv, field, world, capsys):
    watched = {"run": _digest(world / "old-run"), "data": _digest(world)}
    paths = W(world) | {"new": str(world / "new-run" / name.replace(" ", "-"))}
    args = [a.format(**paths) for a in argv]
    with pytest.raises(SystemExit) as stop:
        raise SystemExit(main(args))
    err = capsys.readouterr().err.strip()
    assert stop.value.code == 2, err
    lines = err.splitlines()
    assert len(lines) == 1, err  # one line: no traceback, no usage dump
    assert lines[0].startswith("onegpu: error: ") and field in lines[0], lines[0]
    assert _digest(world / "old-run") == watched["run"]
    assert {k: v for k, v in _digest(world).items() if not k.startswith("new-run")} == {
        k: v for k, v in watched["data"].items() if not k.startswith("new-run")
    }


def test_under_torchrun_the_line_is_the_failure_reports_cause(tmp_path, monkeypatch, capsys):
    """torchrun wraps a failed worker in its own report: the worker's error file carries our
    one line, so the report's root cause is it rather than "To enable traceback see ..."."""
    import json

    error_file = tmp_path / "error.json"
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(error_file))
    monkeypatch.setenv("RANK", "1")  # a worker that does not speak: the file still tells
    assert main(["plan", "--optim.lr", "-1"]) == 2
    assert capsys.readouterr().err == ""
    record = json.loads(error_file.read_text())["message"]
    assert record["extraInfo"]["py_callstack"].startswith("onegpu: error: optim.lr: ")
    assert int(record["extraInfo"]["timestamp"]) > 0
