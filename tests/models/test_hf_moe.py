"""A mixture of experts trains with its router's load-balancing term where its config asks for
it: onegpu's loss equals the model's own `labels=` loss (cross-entropy + coef x aux), plain and
chunked."""

import pytest
import torch

from onegpu.backends.torch.loader import IGNORE_INDEX
from onegpu.config import load_config

transformers = pytest.importorskip("transformers")


def _mixtral(tmp_path, output_router_logits: bool):
    cfg = transformers.MixtralConfig(
        hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=320, max_position_embeddings=128,
        num_local_experts=4, num_experts_per_tok=2, router_aux_loss_coef=0.5,
        output_router_logits=output_router_logits,
    )  # fmt: skip
    cfg.save_pretrained(tmp_path / "moe")  # the architecture: onegpu initialises the weights
    return tmp_path / "moe"


@pytest.mark.parametrize(
    "chunk", ["0", pytest.param("64", marks=pytest.mark.slow)], ids=["plain-loss", "chunked-loss"]
)
def test_the_router_balancing_loss_is_added_as_the_model_adds_it(tmp_path, chunk):
    from onegpu.backends.torch.build import build

    folder = _mixtral(tmp_path, output_router_logits=True)
    cfg = load_config(overrides={"model.hf": str(folder), "model.seq_len": "32",
                                 "train.device": "cpu", "train.precision": "fp32",
                                 "train.batch_size": "2", "train.micro_batch_size": "2",
                                 "memory.loss_chunk": chunk})  # fmt: skip
    built = build(cfg, torch.device("cpu"), with_data=False)
    x = torch.randint(0, 320, (2, 32), generator=torch.Generator().manual_seed(1))
    # the same positions as transformers' shifted labels: every input token is routed
    targets = torch.cat([x[:, 1:], torch.full((2, 1), IGNORE_INDEX)], dim=1)
    ours = built.loss_fn(built.model, x, targets) / (targets != IGNORE_INDEX).sum()
    with torch.no_grad():
        theirs = built.model.hf(input_ids=x, labels=x, use_cache=False)
    assert theirs.aux_loss is not None and theirs.aux_loss > 0
    torch.testing.assert_close(ours.detach(), theirs.loss, rtol=1e-5, atol=1e-6)
    plain = theirs.loss - 0.5 * theirs.aux_loss
    assert abs(ours.item() - plain.item()) > 1e-3  # the term is really there


def test_without_output_router_logits_no_term_is_added(tmp_path):
    from onegpu.backends.torch.build import build

    folder = _mixtral(tmp_path, output_router_logits=False)
    cfg = load_config(overrides={"model.hf": str(folder), "model.seq_len": "32",
                                 "train.device": "cpu", "train.precision": "fp32",
                                 "memory.loss_chunk": "0"})  # fmt: skip
    built = build(cfg, torch.device("cpu"), with_data=False)
    x = torch.randint(0, 320, (2, 32), generator=torch.Generator().manual_seed(1))
    built.model(x)
    assert built.model.auxiliary_loss() is None


def test_weights_saved_in_the_original_expert_layout_load_through_the_conversion(tmp_path):
    """transformers 5 saves a Mixtral's experts one tensor each (`experts.0.w1.weight`) and
    converts them to its fused layout on load: onegpu's build does the same, so the model holds
    exactly what `from_pretrained` gives and its loss is the model's own."""
    from safetensors import safe_open

    from onegpu.backends.torch.build import build

    pytest.importorskip("transformers.conversion_mapping")
    cfg = transformers.MixtralConfig(
        hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=320, max_position_embeddings=128,
        num_local_experts=4, num_experts_per_tok=2,
    )  # fmt: skip
    torch.manual_seed(3)
    transformers.AutoModelForCausalLM.from_config(cfg).save_pretrained(tmp_path / "moe")
    with safe_open(str(tmp_path / "moe" / "model.safetensors"), "pt") as f:
        assert any(".experts.0." in k for k in f.keys())  # noqa: SIM118 - the original layout
    ref = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "moe")
    over = {"model.hf": str(tmp_path / "moe"), "model.seq_len": "32", "train.device": "cpu",
            "train.precision": "fp32", "memory.loss_chunk": "0"}  # fmt: skip
    built = build(load_config(overrides=over), torch.device("cpu"), with_data=False)
    ours = built.model.hf.state_dict()
    assert ours.keys() == ref.state_dict().keys()
    assert all(torch.equal(ours[k], v) for k, v in ref.state_dict().items())
    x = torch.randint(0, 320, (2, 32), generator=torch.Generator().manual_seed(1))
    targets = torch.cat([x[:, 1:], torch.full((2, 1), IGNORE_INDEX)], dim=1)
    loss = built.loss_fn(built.model, x, targets) / (targets != IGNORE_INDEX).sum()
    with torch.no_grad():
        theirs = ref(input_ids=x, labels=x, use_cache=False).loss
    torch.testing.assert_close(loss.detach(), theirs, rtol=1e-5, atol=1e-6)
