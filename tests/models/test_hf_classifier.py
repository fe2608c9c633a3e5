"""An encoder with a sequence-classification head (HF's guide measured bert-large so) through
the same build and step: its own `labels=` loss, techniques, and training on synthetic data."""

import json

import pytest
import torch
import transformers
from conftest import hf_overrides

from onegpu.backends.torch.build import build
from onegpu.backends.torch.loader import classification_targets, count_targets
from onegpu.config import ConfigError, load_config
from onegpu.train import train


def _cfg(folder, **over):
    overrides = hf_overrides(folder, **{"data.source": "synthetic", **over})
    return load_config("tiny", overrides=overrides)


def _batch():
    x = torch.randint(0, 320, (8, 32), generator=torch.Generator().manual_seed(0))
    return x, classification_targets(x, 3)


def _grads(built, x, y):
    built.model.zero_grad(set_to_none=True)
    loss = built.step.forward_backward(x, y, count_targets(y))
    return loss, {
        n: p.grad.clone() for n, p in built.model.named_parameters() if p.grad is not None
    }


def test_classifier_loss_equals_its_own_labels_loss(hf_folder):
    folder = hf_folder("bert")
    built = build(_cfg(folder), torch.device("cpu"), with_data=False)
    assert built.classes == 3
    hf = transformers.AutoModelForSequenceClassification.from_pretrained(folder).eval()
    built.model.eval()
    x, y = _batch()
    with torch.no_grad():
        ours = built.loss_fn(built.model, x, y) / count_targets(y)
        theirs = hf(input_ids=x, labels=y[:, 0]).loss
    torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=1e-6)


def test_classifier_techniques(hf_folder):
    folder = hf_folder("bert")
    x, y = _batch()
    ref_loss, ref = _grads(build(_cfg(folder), torch.device("cpu"), with_data=False), x, y)
    for over in ({"memory.checkpointing": "block"}, {"memory.checkpointing": "attn"}):
        loss, grads = _grads(
            build(_cfg(folder, **over), torch.device("cpu"), with_data=False), x, y
        )
        torch.testing.assert_close(loss, ref_loss)
        for name, g in grads.items():
            torch.testing.assert_close(g, ref[name], rtol=1e-4, atol=1e-6, msg=name)
    few_bit = build(_cfg(folder, **{"memory.gelu_bits": 2}), torch.device("cpu"), with_data=False)
    gelus = [m for m in few_bit.model.modules() if type(m).__name__ == "FewBitGELU"]
    assert len(gelus) == 2 and gelus[0].approximate == "none"  # BERT's exact (erf) GELU
    with pytest.raises(ConfigError, match="memory.checkpointing: BertLayer has no mlp"):
        build(_cfg(folder, **{"memory.checkpointing": "mlp"}), torch.device("cpu"), with_data=False)
    with pytest.raises(ConfigError, match="memory.loss_chunk: a sequence classifier"):
        build(_cfg(folder, **{"memory.loss_chunk": 64}), torch.device("cpu"), with_data=False)


def test_classifier_trains_on_synthetic_data(hf_folder, tmp_path):
    over = {"train.max_steps": "40", "train.eval_every": "40", "optim.lr": "3e-3",
            "train.log_every": "5", "out.dir": str(tmp_path / "run")}  # fmt: skip
    summary = train(_cfg(hf_folder("bert"), **over))
    rows = [json.loads(r) for r in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in rows if "loss" in r]
    assert losses[0] > 0.9 and summary["val_loss"] < 0.5 * losses[0]  # ln 3 = 1.10 at chance
