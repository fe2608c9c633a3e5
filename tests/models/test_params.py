import pytest
import torch

from onegpu.config import load_config
from onegpu.models.gpt import GPT, count_params

KNOWN = {
    # GPT-2 with tied embeddings, as HF's GPT2LMHeadModel counts them.
    "gpt2": 124_439_808,
    "gpt2-medium": 354_823_168,
    "gpt2-large": 774_030_080,
    "gpt2-xl": 1_557_611_200,
    # Seed 000: "Number of parameters: 155_877_376".
    "lippe-150m": 155_877_376,
}


@pytest.mark.parametrize("preset", sorted(KNOWN))
def test_preset_parameter_counts(preset):
    with torch.device("meta"):  # no memory: even gpt2-xl is counted instantly
        model = GPT(load_config(preset).model)
    assert count_params(model) == KNOWN[preset]


def test_meta_build_then_init_keeps_tying_and_gpt2_init(tiny_cfg):
    from onegpu.backends.torch.build import build

    tiny_cfg.model.n_layer = 8
    model = build(tiny_cfg, torch.device("cpu"), with_data=False).model
    assert model.lm_head.weight is model.wte.weight
    assert not any(p.is_meta for p in model.parameters())
    std = tiny_cfg.model.init_std
    fc = model.blocks[0].mlp.fc.weight.std().item()
    proj = model.blocks[0].mlp.proj.weight.std().item()
    assert fc == pytest.approx(std, rel=0.1)
    assert proj == pytest.approx(std / (2 * 8) ** 0.5, rel=0.1)  # scaled residual projection
    assert torch.all(model.blocks[0].attn.q.bias == 0)


def _missing_members(model: torch.nn.Module) -> list[str]:
    """The protocol's members `model` lacks, looked up as techniques read them (getattr).
    Not isinstance: from Python 3.12 it looks members up statically, which misses the blocks
    and head an nn.Module keeps in its registry."""
    from onegpu.models.protocol import LanguageModel

    methods = {n for n, v in vars(LanguageModel).items() if callable(v) and not n.startswith("_")}
    return sorted(n for n in {*LanguageModel.__annotations__, *methods} if not hasattr(model, n))


def test_both_model_kinds_declare_the_model_protocol(tmp_path):
    """What techniques read of a model is declared, not probed: GPT and the HF adapter both."""
    from conftest import make_hf_config

    from onegpu.backends.torch.build import build

    gpt = build(load_config("tiny", overrides={"train.device": "cpu"}), with_data=False).model
    assert _missing_members(gpt) == []
    assert _missing_members(torch.nn.Linear(2, 2)) != []  # the check can fail
    assert (gpt.is_classifier, gpt.logit_transform) == (False, None)
    folder = tmp_path / "llama"
    make_hf_config("llama").save_pretrained(folder)
    cfg = load_config("tiny", overrides={"train.device": "cpu", "model.hf": str(folder)})
    hf = build(cfg, torch.device("cpu"), with_data=False).model
    assert _missing_members(hf) == []
    assert hf.vocab_size == hf.padded_vocab == hf.lm_head.out_features
