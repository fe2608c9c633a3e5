"""Optimizer states in host memory, stepped on the device (memory.offload_states): the same
weights as states kept in place, bit for bit on a CPU, in backward and after it, for plain and
quantized states; checkpoints move between the tiers; the planner puts the states on the host
and prices their trips over the link."""

import pytest
import torch

from onegpu.backends.torch.build import build
from onegpu.config import ConfigError, load_config
from onegpu.optim.in_backward import PerParameterOptimizers

CPU = torch.device("cpu")


def _cfg(states_on_host: bool, **over):
    values = {"train.device": "cpu", "train.precision": "fp32", "train.micro_batch_size": 4,
              "optim.grad_clip": 0.5, "memory.offload_states": str(states_on_host).lower(),
              "memory.loss_chunk": 0, "model.attention": "sdpa"}  # fmt: skip
    return load_config("tiny", overrides={**values, **{k: str(v) for k, v in over.items()}})


def _run(states_on_host: bool, n: int = 3, **over):
    built = build(_cfg(states_on_host, **over), CPU, with_data=False)
    g = torch.Generator().manual_seed(0)
    losses = []
    for i in range(n):
        x = torch.randint(0, 256, (8, 65), generator=g)
        losses.append(built.step(x[:, :-1], x[:, 1:], x[:, 1:].numel(), i).loss.item())
    return built, losses


def _same_weights(a, b) -> bool:
    sa, sb = a.model.state_dict(), b.model.state_dict()
    return all(torch.equal(sa[k], sb[k]) for k in sa)


def _parked(optimizer: PerParameterOptimizers) -> list[torch.Tensor]:
    """The state tensors the per-parameter optimizers hold between steps."""
    return [
        v for opt in optimizer._optimizers.values() for s in opt.state.values()
        for v in s.values() if isinstance(v, torch.Tensor)
    ]  # fmt: skip


CASES = [
    {"optim.name": "adamw"},
    {"optim.name": "adamw", "optim.in_backward": "true", "optim.grad_clip": "0"},
    {"optim.name": "adamw", "optim.in_backward": "true", "optim.grad_clip": "0",
     "train.micro_batch_size": "2"},
    {"optim.name": "sgd", "optim.beta1": "0.9", "train.precision": "bf16-pure"},
]  # fmt: skip


@pytest.mark.parametrize(
    "over", CASES, ids=["after-backward", "in-backward", "in-backward-accumulated", "kahan-sgd"]
)
def test_states_on_the_host_equal_states_in_place_bit_for_bit(over):
    """Each parameter's states leave for the host after its step and come back for the next:
    the weights equal those of the same optimizer with its states in place, exactly."""
    in_place, on_host = _run(False, **over), _run(True, **over)
    assert on_host[0].optimizer.states is not None
    assert in_place[1] == on_host[1]
    assert _same_weights(in_place[0], on_host[0])
    states = on_host[0].optimizer.states
    assert states.host_bytes() > 0
    assert states._next, "the order of the steps was learnt: the next states go out ahead"
    first = next(iter(states._next))
    # in backward the next step's first states went out as this one ended; after backward
    # they would sit on the device through the forward's peak, so they wait on the host
    in_backward = over.get("optim.in_backward") == "true"
    assert list(states._sent) == ([first] if in_backward else [])


@pytest.mark.parametrize("across_steps", [True, False])
def test_a_parameter_alone_never_sends_itself_ahead(across_steps):
    """One parameter is its own successor across steps: sent ahead before its step, it would
    come back with the states as they were before that step. Momentum SGD equals the states
    kept in place, exactly."""
    from onegpu.offload.host_states import HostStates

    start = torch.randn(64, generator=torch.Generator().manual_seed(0))
    weights = [torch.nn.Parameter(start.clone()) for _ in range(2)]
    opts = [torch.optim.SGD([w], lr=0.1, momentum=0.9) for w in weights]
    states = HostStates(CPU, across_steps=across_steps)
    for _ in range(4):
        grad = torch.randn(64)
        for w in weights:
            w.grad = grad.clone()
        opts[0].step()
        with states.visiting(weights[1], opts[1]):
            opts[1].step()
    assert torch.equal(weights[0], weights[1])


@pytest.mark.slow  # torchao compiles its 8-bit step (seconds on a CPU)
def test_torchao_8bit_states_travel_by_their_inner_tensors():
    """torchao's 8-bit moments are tensor subclasses: they cross by their codes and scales,
    and the step equals the one with the states in place, bit for bit."""
    pytest.importorskip("torchao")
    over = {"optim.name": "adamw8bit", "train.precision": "bf16-pure", "optim.in_backward":
            "true", "optim.grad_clip": "0"}  # fmt: skip
    in_place, on_host = _run(False, **over), _run(True, **over)
    assert in_place[1] == on_host[1]
    assert _same_weights(in_place[0], on_host[0])
    kinds = {type(v).__name__ for v in _parked(on_host[0].optimizer)}
    assert "OptimState8bit" in kinds


def test_checkpoints_move_between_host_states_and_states_in_place():
    """A state saved from host memory loads into an optimizer keeping its states in place, and
    the other way round, and both continue alike."""
    over = {"optim.in_backward": "true", "optim.grad_clip": "0"}
    on_host, _ = _run(True, **over)
    in_place, _ = _run(False, **over)
    saved = on_host.optimizer.state_dict()
    in_place.optimizer.load_state_dict(saved)
    back = build(_cfg(True, **over), CPU, with_data=False)
    back.model.load_state_dict(on_host.model.state_dict())
    back.optimizer.load_state_dict(in_place.optimizer.state_dict())
    for a, b in zip(_parked(back.optimizer), _parked(on_host.optimizer), strict=True):
        assert torch.equal(a, b)
    assert back.optimizer.states.host_bytes() == on_host.optimizer.states.host_bytes()


@pytest.mark.parametrize(
    "over, field",
    [
        ({"memory.offload_optimizer": "true"}, "memory.offload_states"),
        ({"memory.offload_params": "true", "dist.strategy": "auto"}, "memory.offload_states"),
        ({"train.precision": "fp16"}, "memory.offload_states"),
        ({"train.backend": "jax"}, "memory.offload_states"),
    ],
    ids=["with-the-host-optimizer", "with-weights-on-the-host", "fp16", "jax"],
)
def test_what_cannot_join_host_states_is_refused(over, field):
    with pytest.raises(ConfigError, match=field):
        _cfg(True, **over)


def test_host_states_are_refused_under_torchrun():
    from onegpu.config import check_distributed

    with pytest.raises(ConfigError, match="memory.offload_states"):
        check_distributed(_cfg(True), "ddp", 2)


@pytest.mark.parametrize(
    "over",
    [
        {"optim.name": "adamw"},
        pytest.param({"optim.name": "adamw8bit"}, marks=pytest.mark.slow),  # compiles
    ],
    ids=["adamw", "adamw8bit"],
)
def test_large_parameters_step_in_slices_as_they_would_whole(over, monkeypatch):
    """Under an elementwise optimizer a parameter above SLICE_ELEMENTS steps a slice of rows
    at a time (here 4,096 elements: the embedding's 256 x 64 in four), its states in host
    memory a slice at a time: the same weights, bit for bit, as the whole tensor stepping.
    (Under bf16-pure torchao rounds stochastically: a slice draws other random numbers, so
    the result is the same in distribution, not bit for bit.)"""
    if over["optim.name"] == "adamw8bit":
        pytest.importorskip("torchao")
    from onegpu.optim import in_backward

    over = {**over, "optim.in_backward": "true", "optim.grad_clip": "0"}
    whole = _run(False, **over)
    monkeypatch.setattr(in_backward, "SLICE_ELEMENTS", 4096)
    sliced = _run(True, **over)
    pieces = sliced[0].optimizer._pieces
    assert max(len(v) for v in pieces.values()) == 4
    assert whole[1] == sliced[1]
    assert _same_weights(whole[0], sliced[0])
