import torch
from torch.utils.flop_counter import FlopCounterMode

from onegpu.models.gpt import GPT
from onegpu.perf.flops import flops_per_token, matmul_params
from onegpu.techniques.loss import token_loss_sum


def test_flops_per_token_matches_flop_counter(tiny_cfg):
    """6N + 12*L*T*D equals what torch counts for a forward+backward pass.

    The plain attention is used: FlopCounterMode has no formula for the CPU flash-attention
    kernel that SDPA dispatches to here, so it would count attention as free.
    """
    tiny_cfg.model.attention = "plain"
    for tie in (True, False):
        tiny_cfg.model.tie_embeddings = tie
        model = GPT(tiny_cfg.model)
        model.init_weights()
        B, T = 2, tiny_cfg.model.seq_len
        x = torch.randint(0, 256, (B, T))
        with FlopCounterMode(display=False) as counter:
            token_loss_sum(model, x, x).backward()
        counted = counter.get_total_flops() / (B * T)
        assert counted == flops_per_token(model, T)


def test_matmul_params_counts_the_tied_output_layer():
    from onegpu.config import load_config

    cfg = load_config("gpt2").model
    with torch.device("meta"):
        model = GPT(cfg)
    # every Linear weight, including lm_head which shares storage with wte (padded: 50,304 rows)
    assert model.padded_vocab == 50304
    blocks = cfg.n_layer * 12 * cfg.d_model**2
    assert matmul_params(model) == blocks + model.padded_vocab * cfg.d_model
    # model FLOPs count the real vocabulary: padding is work, not model FLOPs
    from onegpu.perf.flops import attention_flops_per_token, flops_per_token

    attention = attention_flops_per_token(cfg.n_layer, cfg.seq_len, cfg.d_model)
    expected = 6 * (blocks + cfg.vocab_size * cfg.d_model) + attention
    assert flops_per_token(model, cfg.seq_len) == expected
