"""Padding the vocabulary to a multiple of 64 changes nothing the model computes."""

import pytest
import torch

from onegpu.config import ModelConfig
from onegpu.models.gpt import GPT, count_params
from onegpu.perf.flops import flops_per_token
from onegpu.techniques.chunked_loss import chunked_token_loss_sum
from onegpu.techniques.loss import token_loss_sum


def _pair():
    common = dict(vocab_size=300, seq_len=32, d_model=48, n_layer=2, n_head=4, bias=True)
    torch.manual_seed(0)
    plain = GPT(ModelConfig(**common, pad_vocab_to=1))
    plain.init_weights()
    padded = GPT(ModelConfig(**common, pad_vocab_to=64))
    state = plain.state_dict()
    for key in ("wte.weight", "lm_head.weight"):  # tied: the same tensor under two names
        state[key] = torch.cat([state[key], torch.zeros(20, 48)])
    padded.load_state_dict(state)
    padded.tie_weights()
    return plain, padded


@pytest.mark.parametrize("loss", ["plain", "chunked"])
def test_padded_vocabulary_gives_the_same_loss_and_gradients(loss):
    plain, padded = _pair()
    assert padded.wte.weight.shape[0] == 320 and plain.wte.weight.shape[0] == 300
    assert count_params(padded) == count_params(plain)
    assert flops_per_token(padded, 32) == flops_per_token(plain, 32)
    fn = token_loss_sum if loss == "plain" else chunked_token_loss_sum(16)
    x = torch.randint(0, 300, (3, 33))
    a, b = fn(plain, x[:, :-1], x[:, 1:]), fn(padded, x[:, :-1], x[:, 1:])
    torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
    a.backward()
    b.backward()
    for (name, p), q in zip(plain.named_parameters(), padded.parameters(), strict=True):
        torch.testing.assert_close(q.grad[: p.shape[0]], p.grad, rtol=1e-5, atol=1e-5, msg=name)
    assert torch.all(padded.wte.weight.grad[300:] == 0)  # padding rows never learn
