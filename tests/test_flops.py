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
    # every Linear weight, including lm_head which shares storage with wte
    expected = cfg.n_layer * 12 * cfg.d_model**2 + cfg.vocab_size * cfg.d_model
    assert matmul_params(model) == expected
