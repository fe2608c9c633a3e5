import pytest

from onegpu.cli import main, make_parser
from onegpu.config import Config, ConfigError, load_config, preset_values, to_toml


@pytest.mark.parametrize(
    ("args", "field"),
    [
        (["--model.n_layre", "3"], "model.n_layre"),  # unknown field
        (["--model.n_layer", "three"], "model.n_layer"),  # wrong type
        (["--model.tie_embeddings", "yes"], "model.tie_embeddings"),
        (["--model.d_model", "100", "--model.n_head", "3"], "model.d_model"),
        (["--train.batch_size", "10", "--train.micro_batch_size", "4"], "train.batch_size"),
        (["--data.seq_len", "128"], "data.seq_len"),  # tiny's context is 64
        (["--train.precision", "tf32"], "train.precision"),  # no tf32 on a CPU
        (["--train.precision", "fp8"], "train.precision"),
        (["--optim.name", "adamw9"], "optim.name"),
        (["--train.device", "cuda:7"], "train.device"),
        (["--data.source", "/nonexistent/corpus.txt"], "data.source"),
        # refused combinations of techniques
        (
            ["--optim.in_backward", "true", "--train.micro_batch_size", "8"],
            "optim.grad_clip",
        ),
        (
            ["--optim.in_backward", "true", "--optim.grad_clip", "0"]
            + ["--train.micro_batch_size", "8", "--train.precision", "fp16"],
            "train.precision",
        ),
        (["--train.precision", "bf16-pure", "--optim.name", "adafactor"], "optim.name"),
    ],
)
def test_bad_input_exits_2_naming_the_field(args, field, tmp_path, capsys):
    out = tmp_path / "run"
    code = main(["train", "--preset", "tiny", "--train.device", "cpu", "--out", str(out), *args])
    err = capsys.readouterr().err
    assert code == 2
    assert err.startswith(f"onegpu: error: {field}:"), err
    assert len(err.strip().splitlines()) == 1
    assert not out.exists()  # nothing written


def test_unknown_option_suggests_the_close_name(capsys):
    assert main(["train", "--preset", "tiny", "--train.max_step", "3"]) == 2
    assert "did you mean --train.max_steps?" in capsys.readouterr().err


def test_existing_run_folder_is_not_damaged(tmp_path, capsys):
    (tmp_path / "summary.json").write_text("precious")
    assert main(["train", "--preset", "tiny", "--train.device", "cpu", "--out", str(tmp_path)]) == 2
    assert "out.dir" in capsys.readouterr().err
    assert (tmp_path / "summary.json").read_text() == "precious"


def test_precedence_preset_then_file_then_command_line(tmp_path):
    f = tmp_path / "c.toml"
    f.write_text('preset = "tiny"\n[model]\nn_layer = 3\nd_model = 96\n[optim]\nlr = 0.5\n')
    cfg = load_config(None, f, {"model.n_layer": "5"})
    assert cfg.model.n_layer == 5  # command line beats file
    assert cfg.model.d_model == 96  # file beats preset
    assert cfg.model.seq_len == 64  # preset (tiny) beats defaults
    assert cfg.optim.lr == 0.5
    assert load_config("small", f).model.seq_len == 256  # --preset beats the file's preset line


def test_file_errors_name_the_field(tmp_path):
    f = tmp_path / "c.toml"
    f.write_text("[model]\nn_layers = 3\n")
    with pytest.raises(
        ConfigError, match=r"model.n_layers: unknown option; did you mean model.n_layer\?"
    ):
        load_config(None, f)
    f.write_text('[train]\nbatch_size = "8"\n')
    with pytest.raises(ConfigError, match="train.batch_size: expected an integer"):
        load_config(None, f)
    f.write_text("[train\n")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_config(None, f)


def test_defaults_are_the_small_preset_and_resolved_config_round_trips(tmp_path):
    assert load_config() == load_config("small")
    assert Config() == load_config("small")  # the dataclass defaults are the small preset
    cfg = load_config("seed-ref", overrides={"optim.lr": "1e-4"})
    f = tmp_path / "resolved.toml"
    f.write_text(to_toml(cfg))
    assert load_config(None, f) == cfg


def test_every_preset_loads_and_validates():
    from onegpu.config import preset_names

    assert {
        "tiny",
        "small",
        "seed-ref",
        "lippe-150m",
        "gpt2",
        "gpt2-medium",
        "gpt2-large",
        "gpt2-xl",
    } <= set(preset_names())
    for name in preset_names():
        assert preset_values(name)
        load_config(name)


def test_help_shows_each_fields_documentation(capsys):
    with pytest.raises(SystemExit):
        make_parser().parse_args(["train", "--help"])
    out = capsys.readouterr().out
    assert "--model.n_layer" in out and "Number of transformer blocks" in out
    assert "--optim.grad_clip" in out and "global L2 norm" in out


def test_a_toml_file_with_a_utf8_byte_order_mark_loads(tmp_path):
    """Editors on Windows write one; it is not part of the TOML."""
    path = tmp_path / "bom.toml"
    path.write_bytes(b"\xef\xbb\xbf[train]\nmax_steps = 3\n")
    assert load_config("tiny", path).train.max_steps == 3
