"""The paths only an accelerator takes: pinned host buffers, side streams, the host link.

Each compares the GPU run with offload against the same GPU run without it (or the planner's
prediction against `torch.cuda.max_memory_allocated`). Marked `gpu`: deselected on machines
without CUDA (tests/conftest.py), run with `pytest -m gpu`."""

import gc

import pytest
import torch

from onegpu.backends.torch.build import build, processes
from onegpu.config import load_config
from onegpu.models import gpt
from onegpu.plan.budget import plan_budget
from onegpu.plan.memory import plan_memory
from onegpu.techniques.precision import device_caps

pytestmark = pytest.mark.gpu


def _cfg(**over):
    values = {"train.device": "cuda", "train.precision": "fp32", "train.compile": "none",
              "model.dropout": "0", "model.attention": "math", "optim.grad_clip": "0",
              "memory.loss_chunk": "0", **over}  # fmt: skip
    return load_config("tiny", overrides=values)


@pytest.fixture(scope="module")
def initial_weights(tmp_path_factory) -> str:
    """One set of starting weights for every run: a model initialises from the generator of
    the device its weights live on (the host's under FSDP2's CPU offload, the GPU's
    otherwise), so runs compared for equality start from a file (model.init_from)."""
    from safetensors.torch import save_model

    built = build(load_config("tiny", overrides={"train.device": "cpu"}), with_data=False)
    path = tmp_path_factory.mktemp("init") / "model.safetensors"
    save_model(built.model, str(path))
    return str(path)


def _steps(cfg, n: int = 3):
    """n steps on fixed random batches; the built run and its losses."""
    with processes(cfg) as ctx:
        built = build(cfg, with_data=False, dist_ctx=ctx)
        g = torch.Generator().manual_seed(0)
        losses = []
        for i in range(n):
            x = torch.randint(0, cfg.model.vocab_size, (8, cfg.train_seq_len + 1), generator=g)
            x = x.to(built.device)
            losses.append(built.step(x[:, :-1], x[:, 1:], x[:, 1:].numel(), i).loss.item())
        torch.cuda.synchronize()
        weights = {k: v.detach().float().cpu() for k, v in built.model.state_dict().items()}
    return built, losses, weights


def test_the_host_optimizer_on_a_gpu_follows_the_device_optimizer(initial_weights):
    """States on the host, weight copies pinned (they cross the link), gradients gone from the
    device after backward; AdamW on the CPU gives the GPU's weights up to rounding (the
    kernels differ, not the math)."""
    init = {"model.init_from": initial_weights}
    plain = _steps(_cfg(**init))
    host = _steps(_cfg(**init, **{"memory.offload_optimizer": "true"}))
    states = [t for s in host[0].optimizer.state.values() for t in s.values() if t.dim() > 0]
    assert states and all(t.device.type == "cpu" for t in states)
    assert all(h.is_pinned() for h in host[0].optimizer.grad_params)
    assert all(p.grad is None for p in host[0].model.parameters())
    assert host[1] == pytest.approx(plain[1], rel=1e-5)
    for name, w in plain[2].items():
        if name.endswith("attn.k.bias"):
            # A key bias adds the same q.b to every score of a query: softmax ignores it, so
            # its gradient is rounding noise (1e-10), which AdamW scales to full steps of
            # either sign: the GPU's and the CPU's noise differ (the H200 run saw this).
            continue
        torch.testing.assert_close(host[2][name], w, rtol=1e-4, atol=1e-6, msg=name)


def test_activations_on_the_host_of_a_gpu_give_the_same_steps(initial_weights):
    """Saved activations go to pinned host memory and come back exactly: same losses."""
    init = {"model.init_from": initial_weights}
    plain = _steps(_cfg(**init))
    off = _steps(_cfg(**init, **{"memory.offload_activations": "true"}))
    assert off[1] == pytest.approx(plain[1], rel=1e-6)


def test_weights_on_the_host_through_fsdp2_follow_the_device_run(initial_weights):
    """FSDP2's CPU offload in a process group of one: from the same starting weights, the
    same losses up to rounding (the optimizer steps on the CPU)."""
    init = {"model.init_from": initial_weights}
    plain = _steps(_cfg(**init))
    off = _steps(_cfg(**init, **{"memory.offload_params": "true"}))
    assert off[1] == pytest.approx(plain[1], rel=1e-5)


@pytest.mark.parametrize(
    "precision, policy",
    [("bf16", "none"), ("bf16", "block"), ("bf16", "budget:1100000000"), ("bf16-pure", "none"),
     ("bf16-pure, torch's LayerNorm", "none")],
)  # fmt: skip
def test_the_planned_peak_on_a_gpu_is_within_ten_percent(precision, policy, monkeypatch):
    """The planner's step peak against the caching allocator's, cuBLAS's workspaces included;
    under bf16-pure with torch's LayerNorm, the fp32 copies CUDA's autocast makes of its bf16
    input (plan/cuda_autocast.py); with onegpu's, none."""
    if precision.endswith("torch's LayerNorm"):
        monkeypatch.setattr(gpt.LayerNorm, "forward", torch.nn.LayerNorm.forward)
        precision = "bf16-pure"
    over = {"train.precision": precision, "model.n_layer": "8", "model.d_model": "512",
            "model.n_head": "8", "model.seq_len": "512", "model.vocab_size": "8192",
            "train.batch_size": "8", "train.micro_batch_size": "8", "model.attention": "auto",
            "memory.checkpointing": policy}  # fmt: skip
    cfg = _cfg(**over)
    cuda = torch.device("cuda")
    caps = device_caps(cuda)
    if policy.startswith("budget:"):  # resolved to a per-block plan, as `onegpu train` does
        cfg, decided = plan_budget(cfg, "cuda", caps, None)
        assert decided["planned_peak"] <= decided["budget"]
    planned = plan_memory(cfg, "cuda", caps).memory["peak"]
    gc.collect()
    # what earlier tests left alive, if anything: the cuBLAS workspaces of this thread and of
    # autograd's among it where earlier tests made them (torch keeps them per thread), which
    # the plan counts: then the plan is up to 64 MiB over, within the tolerance
    before = torch.cuda.memory_allocated()
    built = build(cfg, with_data=False)
    x = torch.randint(0, 8192, (8, 513), device=cuda)
    built.step(x[:, :-1], x[:, 1:], x[:, 1:].numel(), 0)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    built.step(x[:, :-1], x[:, 1:], x[:, 1:].numel(), 1)
    torch.cuda.synchronize()
    measured = torch.cuda.max_memory_allocated() - before
    assert planned == pytest.approx(measured, rel=0.10)


@pytest.mark.parametrize(
    "over",
    [
        {"optim.in_backward": "true"},
        {"optim.in_backward": "false", "train.micro_batch_size": "4"},
        {"optim.in_backward": "true", "optim.name": "adamw8bit", "train.precision": "bf16"},
    ],
    ids=["in-backward", "after-backward-accumulated", "8bit-in-backward"],
)
def test_states_on_the_host_of_a_gpu_step_as_states_in_place(initial_weights, over):
    """memory.offload_states on a GPU: the states wait pinned on the host, go out on the side
    stream (the next parameter's while one steps) and come back after its step; the same
    kernels run on the same values, so the weights equal the states-in-place run's exactly,
    and the parked states are host tensors."""
    init = {"model.init_from": initial_weights, **over}
    _, in_place, w_in_place = _steps(_cfg(**init))
    built, on_host, w_on_host = _steps(_cfg(**init, **{"memory.offload_states": "true"}))
    assert on_host == in_place
    assert all(torch.equal(w_on_host[k], w_in_place[k]) for k in w_in_place)
    states = built.optimizer.states
    assert states.host_bytes() > 0 and states._next
    parked = [v for s in states._parked.values() for v in s.values() if isinstance(v, torch.Tensor)]
    assert parked and all(v.device.type == "cpu" for v in parked)


def test_bf16_matmul_weights_on_a_gpu_with_fp32_masters_on_the_host(initial_weights):
    """bf16 autocast, the optimizer on the host: the device's matmul weights are bf16 and the
    losses follow the plain bf16 run's up to the CPU's and GPU's AdamW rounding."""
    init = {"model.init_from": initial_weights, "train.precision": "bf16"}
    _, plain, _ = _steps(_cfg(**init))
    built, off, _ = _steps(_cfg(**init, **{"memory.offload_optimizer": "true"}))
    assert any(p.dtype == torch.bfloat16 for p in built.model.parameters())
    assert off == pytest.approx(plain, rel=1e-3)
