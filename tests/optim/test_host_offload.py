"""The optimizer in host memory (memory.offload_optimizer) computes what the device optimizer
computes: bit for bit on a CPU for fp32 AdamW and SGD (with accumulation, clipping, the guard
and fp16 loss scaling), its checkpoints resume either way, and gradients leave the parameters
as backward produces them."""

import pytest
import torch

from onegpu.backends.torch.build import build
from onegpu.config import ConfigError, check_distributed, load_config
from onegpu.offload.host_optimizer import HostOffloadOptimizer

CPU = torch.device("cpu")


def _cfg(offload: bool, **over):
    values = {"train.device": "cpu", "train.precision": "fp32", "train.micro_batch_size": 2,
              "optim.grad_clip": 0.5, "memory.offload_optimizer": str(offload).lower(),
              "memory.loss_chunk": 0, "model.attention": "sdpa"}  # fmt: skip
    return load_config("tiny", overrides={**values, **{k: str(v) for k, v in over.items()}})


def _run(offload: bool, n: int = 4, poison: int | None = None, **over):
    """n steps of the real build and step on fixed random batches; `poison`: the step whose
    loss is made non-finite (the guard must skip it)."""
    built = build(_cfg(offload, **over), CPU, with_data=False)
    g = torch.Generator().manual_seed(0)
    losses, norms, skipped = [], [], []
    for i in range(n):
        x = torch.randint(0, 256, (8, 65), generator=g)
        if i == poison:  # the weight comes back as it was: the step must leave no trace
            kept = built.model.lm_head.weight[0, 0].item()
            with torch.no_grad():
                built.model.lm_head.weight[0, 0] = float("nan")
        out = built.step(x[:, :-1], x[:, 1:], x[:, 1:].numel(), i)
        losses.append(out.loss.item())
        norms.append(out.grad_norm.item())
        skipped.append(bool(out.skipped))
        if i == poison:
            with torch.no_grad():
                built.model.lm_head.weight[0, 0] = kept
    return built, losses, norms, skipped


def _same_weights(a, b) -> bool:
    sa, sb = a.model.state_dict(), b.model.state_dict()
    return all(torch.equal(sa[k], sb[k]) for k in sa)


@pytest.mark.parametrize(
    "over",
    [
        {"optim.name": "adamw"},
        {"optim.name": "sgd", "optim.beta1": "0.9"},
        {"optim.name": "adamw", "train.precision": "fp16"},
        {"optim.name": "adafactor", "optim.grad_clip": "0"},
    ],
    ids=["adamw", "sgd", "fp16-scaled", "adafactor"],
)
def test_offloaded_equals_on_device_bit_for_bit(over):
    plain, off = _run(False, **over), _run(True, **over)
    assert isinstance(off[0].optimizer, HostOffloadOptimizer)
    assert plain[1:] == off[1:]  # losses, norms, skipped flags
    assert _same_weights(plain[0], off[0])


@pytest.mark.parametrize("micro", ["8", "2"], ids=["one-micro-batch", "accumulated"])
def test_in_backward_on_the_host_equals_the_plain_step_bit_for_bit(micro):
    """optim.in_backward with the optimizer in host memory: each host copy steps as its whole
    gradient lands (in the last micro-batch's backward) and goes back to the parameter; the
    weights equal the plain device step's exactly, and no gradient stays on the device."""
    over = {"optim.grad_clip": "0", "train.micro_batch_size": micro}
    plain = _run(False, **over)
    host = _run(True, **over, **{"optim.in_backward": "true"})
    assert host[0].optimizer.steps_in_backward
    assert plain[1] == host[1]  # the losses: the weights agreed at every step
    assert host[2] == pytest.approx(plain[2], rel=1e-5)  # norms: summed in another order
    assert _same_weights(plain[0], host[0])
    assert all(p.grad is None for p in host[0].model.parameters())


@pytest.mark.gpu
def test_in_backward_on_the_host_steps_beside_a_gpu_backward_exactly():
    """On a GPU the host copies step on a worker thread while backward goes on, and the
    weights come back on the side stream: equal bit for bit to the host step after backward
    (the same CPU optimizer on the same gradients), with accumulation."""
    cuda = torch.device("cuda")
    over = {"optim.grad_clip": "0", "train.device": "cuda", "train.micro_batch_size": "2"}
    results = []
    for in_backward in ("false", "true"):
        built = build(_cfg(True, **over, **{"optim.in_backward": in_backward}), cuda,
                      with_data=False)  # fmt: skip
        g = torch.Generator().manual_seed(0)
        for i in range(3):
            x = torch.randint(0, 256, (8, 65), generator=g).to(cuda)
            built.step(x[:, :-1], x[:, 1:], x[:, 1:].numel(), i)
        torch.cuda.synchronize()
        assert all(p.grad is None for p in built.model.parameters())
        results.append(built)
    assert results[1].optimizer.steps_in_backward
    assert _same_weights(results[0], results[1])


def test_the_guard_skips_a_non_finite_step_alike():
    plain, off = _run(False, n=4, poison=1), _run(True, n=4, poison=1)
    assert plain[3] == off[3] == [False, True, False, False]
    assert plain[1][2:] == off[1][2:]
    assert _same_weights(plain[0], off[0])


@pytest.mark.parametrize("over", [{"optim.name": "adamw8bit"},
                                  {"train.precision": "bf16-pure", "optim.name": "adamw"}],
                         ids=["adamw8bit-host-states", "bf16-pure-kahan"])  # fmt: skip
def test_lean_optimizers_run_on_the_host_as_on_the_device(over):
    """8-bit AdamW keeps 8-bit states on the host; bf16-pure keeps Kahan compensation there."""
    plain, off = _run(False, **over), _run(True, **over)
    torch.testing.assert_close(torch.tensor(off[1]), torch.tensor(plain[1]), rtol=1e-3, atol=0)
    states = [t for s in off[0].optimizer.state.values() for t in s.values()
              if isinstance(t, torch.Tensor)]  # fmt: skip
    assert states and all(t.device.type == "cpu" for t in states)


def test_checkpoints_move_between_offloaded_and_on_device(tmp_path):
    """The host optimizer's state_dict has the device optimizer's layout: a checkpoint written
    either way continues the other way, bit-exactly."""
    straight = _run(False, n=4)
    for first, then in [(True, False), (False, True)]:
        a = _run(first, n=2)[0]
        state = {"model": a.model.state_dict(), "optim": a.optimizer.state_dict()}
        torch.save(state, tmp_path / "ck.pt")
        b = build(_cfg(then), CPU, with_data=False)
        loaded = torch.load(tmp_path / "ck.pt", weights_only=True)
        b.model.load_state_dict(loaded["model"])
        b.optimizer.load_state_dict(loaded["optim"])
        g = torch.Generator().manual_seed(0)
        losses = []
        for i in range(4):
            x = torch.randint(0, 256, (8, 65), generator=g)
            if i >= 2:
                losses.append(b.step(x[:, :-1], x[:, 1:], x[:, 1:].numel(), i).loss.item())
        assert losses == straight[1][2:], (first, then)
        assert _same_weights(b, straight[0])


def test_gradients_leave_the_parameters_as_backward_produces_them():
    """Each parameter's gradient is moved to the host by its own hook, once per micro-batch,
    in the order backward produces them (the last block before the first), and no parameter
    holds a gradient once backward is done."""
    built = build(_cfg(True), CPU, with_data=False)
    opt = built.optimizer
    names = {p: n for n, p in built.model.named_parameters()}
    order: list[tuple[str, bool]] = []
    hook = opt._offload_grad

    def recording(p):
        hook(p)
        order.append((names[p], p.grad is None))

    opt._offload_grad = recording
    for p in names:  # the hooks hold the bound method: register the recorder in their place
        p._post_accumulate_grad_hooks.clear()
        p.register_post_accumulate_grad_hook(opt._offload_grad)
    x = torch.randint(0, 256, (8, 65), generator=torch.Generator().manual_seed(0))
    built.step.forward_backward(x[:, :-1], x[:, 1:], x[:, 1:].numel())
    per_micro = len(names)
    assert built.step.n_micro == 4
    assert len(order) == 4 * per_micro  # each parameter once in each micro-batch
    assert all(freed for _, freed in order)  # freed on the device right after leaving
    assert all(p.grad is None for p in names)
    first = [n for n, _ in order[:per_micro]]
    assert first.index("blocks.1.mlp.proj.weight") < first.index("blocks.0.mlp.proj.weight")
    assert first.index("blocks.0.attn.q.weight") < first.index("wpe.weight")
    assert any(h.grad.abs().sum() > 0 for h in opt.grad_params)  # the batch's gradients landed


def test_bad_combinations_are_refused(tmp_path):
    with pytest.raises(ConfigError, match="memory.offload_dir"):
        load_config("tiny", overrides={"memory.offload_optimizer": "true", "optim.in_backward":
                                       "true", "optim.grad_clip": "0",
                                       "memory.offload_dir": str(tmp_path)})  # fmt: skip
    with pytest.raises(ConfigError, match="memory.offload_optimizer"):
        check_distributed(_cfg(True), "ddp", 2)


def test_under_bf16_the_device_keeps_bf16_matmul_weights_and_the_host_fp32_masters():
    """bf16 autocast with the optimizer on the host: the matmul weights live in bf16 on the
    device (autocast would cast them so for every matmul), embeddings and norms in fp32, the
    fp32 masters on the host. The losses and the masters equal the plain bf16 run's fp32
    weights bit for bit; the checkpoint's model state is the masters."""
    from onegpu.backends.torch.checkpoint import model_state
    from onegpu.optim.factory import matmul_weights

    over = {"train.precision": "bf16", "train.micro_batch_size": "4"}
    plain, off = _run(False, **over), _run(True, **over)
    # an untied output layer under the chunked loss (fp32 sums: it stays fp32) too
    head = {**over, "model.tie_embeddings": "false", "memory.loss_chunk": "64"}
    assert _run(False, **head)[1:] == _run(True, **head)[1:]
    assert plain[1:] == off[1:]
    model = off[0].model
    sixteen = matmul_weights(model)
    assert sixteen, "the GPT's attention and MLP weights are cast"
    for p in model.parameters():
        assert p.dtype == (torch.bfloat16 if id(p) in sixteen else torch.float32)
    saved, want = model_state(off[0]), plain[0].model.state_dict()
    assert saved.keys() == want.keys()
    assert all(saved[k].dtype == want[k].dtype and torch.equal(saved[k], want[k]) for k in want)
    again = build(_cfg(True, **over), CPU, with_data=False)
    again.model.load_state_dict(saved)
    again.optimizer.take_weights(again.model, saved)
    assert all(torch.equal(a, b) for a, b in zip(model_state(again).values(), want.values()))
