"""The low-rank optimizers on a GPU: APOLLO's random projections drawn on the device from
generators seeded per matrix and step (optim/low_rank.py forks the CUDA generator too), so a
matrix stepped alone in backward gets what the plain step gives it. Marked `gpu`."""

import pytest
import torch

from onegpu.backends.torch.build import build
from onegpu.config import load_config

pytestmark = pytest.mark.gpu


def _run(**over):
    values = {"train.device": "cuda", "train.precision": "fp32", "model.attention": "math",
              "optim.name": "apollo", "optim.rank": "16", "optim.update_proj_gap": "2",
              "optim.grad_clip": "0", "memory.loss_chunk": "0", "model.dropout": "0.1",
              "train.batch_size": "8", "train.micro_batch_size": "8", **over}  # fmt: skip
    built = build(load_config("tiny", overrides=values), with_data=False)
    g = torch.Generator().manual_seed(0)
    for i in range(4):
        x = torch.randint(0, 256, (8, 65), generator=g).cuda()
        built.step(x[:, :-1], x[:, 1:], x[:, 1:].numel(), i)
    torch.cuda.synchronize()
    return {k: v.detach().cpu() for k, v in built.model.state_dict().items()}


def test_apollo_on_a_gpu_draws_the_same_projections_in_backward():
    torch.manual_seed(0)
    plain = _run()
    torch.manual_seed(0)  # dropout's masks: the same global generator for both runs
    alone = _run(**{"optim.in_backward": "true"})
    for name, w in plain.items():
        torch.testing.assert_close(alone[name], w, rtol=1e-5, atol=1e-6, msg=name)
