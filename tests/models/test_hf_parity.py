"""Our GPT equals Hugging Face's GPT-2 (the reference implementation) on the same weights."""

import pytest
import torch
import transformers

from onegpu.config import ModelConfig
from onegpu.models.convert import load_hf_gpt2
from onegpu.models.gpt import GPT, count_params


@pytest.mark.parametrize("attention", ["sdpa", "plain"])
def test_logits_match_hf_gpt2(attention):
    hf_cfg = transformers.GPT2Config(
        vocab_size=300,
        n_positions=32,
        n_embd=48,
        n_layer=3,
        n_head=4,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
    )
    torch.manual_seed(0)
    hf = transformers.GPT2LMHeadModel(hf_cfg).eval()
    ours = GPT(
        ModelConfig(
            vocab_size=300, seq_len=32, d_model=48, n_layer=3, n_head=4, attention=attention
        )
    )
    load_hf_gpt2(ours, hf.state_dict()).eval()
    assert count_params(ours) == sum(p.numel() for p in hf.parameters())
    idx = torch.randint(0, 300, (2, 32))
    with torch.no_grad():
        logits = ours(idx)
        assert logits.shape[-1] == 320  # 300 padded to a multiple of 64, padding masked
        assert torch.all(logits[..., 300:] == float("-inf"))
        torch.testing.assert_close(logits[..., :300], hf(idx).logits, rtol=1e-5, atol=1e-5)
