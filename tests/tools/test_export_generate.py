"""Weights out: `onegpu export` folders that transformers loads with the run's logits; GPT-2
weights in and out through the production converter; generate, TensorBoard and plot."""

import pytest
import torch
import transformers

from onegpu.cli import main
from onegpu.config import ConfigError, ModelConfig, load_config
from onegpu.models.convert import hf_gpt2_state_dict, load_hf_gpt2
from onegpu.models.gpt import GPT
from onegpu.tools.export import export
from onegpu.tools.generate import generate
from onegpu.tools.trained import load_trained
from onegpu.train import train


def _train(out, **over):
    base = {
        "train.device": "cpu",
        "train.max_steps": "6",
        "train.eval_every": "3",
        "train.log_every": "2",
        "train.measure_memory": "false",
        "out.progress": "false",
        "out.dir": str(out),
    }
    train(load_config("tiny", overrides=base | {k: str(v) for k, v in over.items()}))
    return out


@pytest.fixture(scope="module")
def gpt_run(tmp_path_factory):
    return _train(tmp_path_factory.mktemp("gpt") / "run", **{"out.tensorboard": "true"})


def _logits_match(run, folder):
    trained = load_trained(run)
    back = transformers.AutoModelForCausalLM.from_pretrained(folder, local_files_only=True).eval()
    V = trained.cfg.model.vocab_size
    idx = torch.randint(0, V, (2, 24), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        torch.testing.assert_close(
            trained.model(idx)[..., :V], back(input_ids=idx).logits, rtol=1e-5, atol=1e-5
        )


def test_export_of_our_gpt_is_a_gpt2_folder_with_the_same_logits(gpt_run, tmp_path):
    result = export(gpt_run, tmp_path / "hf")
    assert (
        result["architecture"] == "GPT2LMHeadModel" and result["parity_max_abs_logit_diff"] < 1e-5
    )
    _logits_match(gpt_run, tmp_path / "hf")
    tok = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf", local_files_only=True)
    assert tok("def f():")["input_ids"] == list(b"def f():")  # the byte tokenizer, exported
    with pytest.raises(ConfigError, match="--out: .* is not empty"):
        export(gpt_run, tmp_path / "hf")


def test_export_of_a_hf_run_is_its_own_architecture_trained(hf_folder, tmp_path):
    folder = hf_folder("llama")
    run = _train(tmp_path / "run", **{"model.hf": folder, "model.seq_len": 32})
    result = export(run, tmp_path / "out")
    assert result["architecture"] == "LlamaForCausalLM"
    _logits_match(run, tmp_path / "out")
    before = transformers.AutoModelForCausalLM.from_pretrained(folder).model.norm.weight
    after = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").model.norm.weight
    assert not torch.equal(before, after)  # the trained weights, not the folder's


def test_bias_free_gpt_exports_exactly_and_a_biased_head_is_refused():
    cfg = ModelConfig(vocab_size=300, seq_len=32, d_model=48, n_layer=2, n_head=4, bias=False)
    ours = GPT(cfg)
    ours.init_weights()
    hf = transformers.GPT2LMHeadModel(
        transformers.GPT2Config(vocab_size=300, n_positions=32, n_embd=48, n_layer=2, n_head=4)
    )
    hf.load_state_dict(hf_gpt2_state_dict(ours), strict=False)
    idx = torch.randint(0, 300, (2, 32))
    with torch.no_grad():
        torch.testing.assert_close(
            ours(idx)[..., :300], hf.eval()(idx).logits, rtol=1e-5, atol=1e-5
        )
    untied = GPT(ModelConfig(vocab_size=300, seq_len=32, d_model=48, n_layer=1, n_head=4,
                             tie_embeddings=False))  # fmt: skip
    from onegpu.models.convert import gpt2_config_kwargs

    with pytest.raises(ConfigError, match="model.bias: .*lm_head"):
        gpt2_config_kwargs(untied)


def test_gpt2_weights_round_trip_through_the_converters():
    cfg = ModelConfig(vocab_size=300, seq_len=32, d_model=48, n_layer=2, n_head=4)
    a = GPT(cfg)
    a.init_weights()
    b = load_hf_gpt2(GPT(cfg), hf_gpt2_state_dict(a))
    for (name, p), q in zip(a.state_dict().items(), b.state_dict().values(), strict=True):
        assert torch.equal(p, q), name


@pytest.mark.slow
def test_a_gpt2_folder_trains_with_model_hf(hf_folder, tmp_path):
    run = _train(tmp_path / "run", **{"model.hf": hf_folder("gpt2"), "model.seq_len": 32})
    rows = [line for line in (run / "metrics.jsonl").read_text().splitlines() if '"loss"' in line]
    import json

    losses = [json.loads(r)["loss"] for r in rows]
    assert losses[-1] < losses[0]


def test_generate_is_deterministic_under_a_seed(gpt_run):
    a = generate(str(gpt_run), "def ", max_new_tokens=20, seed=7)
    b = generate(str(gpt_run), "def ", max_new_tokens=20, seed=7)
    greedy = generate(str(gpt_run), "def ", max_new_tokens=20, temperature=0)
    assert a == b and len(a) > 0
    assert {generate(str(gpt_run), "def ", max_new_tokens=20, seed=s) for s in range(4)} != {a}
    assert greedy == generate(str(gpt_run), "def ", max_new_tokens=20, temperature=0, seed=99)


def test_tensorboard_events_are_written_and_readable(gpt_run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(gpt_run / "tensorboard"))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    assert {"train/loss", "train/lr", "train/grad_norm", "speed/tokens_per_s", "eval/loss",
            "memory/peak_bytes"} <= tags  # fmt: skip
    assert [e.step for e in acc.Scalars("train/loss")] == [2, 4, 6]
    assert [e.step for e in acc.Scalars("eval/loss")] == [3, 6]


def test_plot_writes_a_png(gpt_run, tmp_path, capsys):
    assert main(["plot", str(gpt_run), str(gpt_run), "--out", str(tmp_path / "l.png")]) == 0
    data = (tmp_path / "l.png").read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000
    assert main(["plot", str(tmp_path), "--out", str(tmp_path / "x.png")]) == 2
    assert "has no metrics.jsonl" in capsys.readouterr().err


def test_a_tensor_parallel_runs_model_loads_in_one_process(gpt_run, tmp_path):
    """A run folder's training layout (here tensor parallel, compiled and checkpointed, with
    an SDPA kernel that layout refuses on a CPU) does not bind the one process that loads its
    model for generate, eval and export: the same weights, the same logits."""
    import shutil

    from onegpu.config.loading import to_toml, with_overrides

    run = tmp_path / "tp-run"
    shutil.copytree(gpt_run, run)
    cfg = load_config(file=run / "config.toml")
    layout = {
        "model.attention": "flash",
        "dist.tp": "2",
        "train.compile": "regional",
        "memory.checkpointing": "block",
    }
    (run / "config.toml").write_text(to_toml(with_overrides(cfg, layout)))
    trained, original = load_trained(run), load_trained(gpt_run)
    assert trained.cfg.model.attention == "flash"
    idx = torch.randint(0, trained.cfg.model.vocab_size, (2, 16))
    with torch.no_grad():
        torch.testing.assert_close(trained.model(idx), original.model(idx))
