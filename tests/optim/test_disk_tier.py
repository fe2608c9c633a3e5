"""The disk tier (memory.offload_dir): the host optimizer's weight copies and states in
memory-mapped files compute what host memory computes, bit for bit, resume either way, and
leave nothing behind."""

import gc

import pytest
import torch

from onegpu.backends.torch.build import build
from onegpu.config import ConfigError, load_config
from onegpu.offload.disk_tier import DiskTier

CPU = torch.device("cpu")


def _cfg(disk, **over):
    values = {"train.device": "cpu", "train.precision": "fp32", "train.micro_batch_size": 2,
              "optim.grad_clip": 0.5, "memory.offload_optimizer": "true",
              "memory.loss_chunk": 0, "model.attention": "sdpa",
              "memory.offload_dir": str(disk) if disk else ""}  # fmt: skip
    return load_config("tiny", overrides={**values, **{k: str(v) for k, v in over.items()}})


def _steps(built, n: int, start: int = 0):
    g = torch.Generator().manual_seed(0)
    losses = []
    for i in range(n):
        x = torch.randint(0, 256, (8, 65), generator=g)
        if i >= start:
            losses.append(built.step(x[:, :-1], x[:, 1:], x[:, 1:].numel(), i).loss.item())
    return losses


def _same(a, b) -> bool:
    sa, sb = a.model.state_dict(), b.model.state_dict()
    return all(torch.equal(sa[k], sb[k]) for k in sa)


def _state_tensors(opt):
    out = []
    for per_param in opt.state.values():
        for t in per_param.values():
            if isinstance(t, torch.Tensor) and t.numel() > 1:
                if type(t) is not torch.Tensor and hasattr(t, "__tensor_flatten__"):
                    out += [getattr(t, n) for n in t.__tensor_flatten__()[0]]
                else:
                    out.append(t)
    return out


@pytest.mark.parametrize(
    "over",
    [{"optim.name": "adamw"}, {"optim.name": "sgd", "optim.beta1": "0.9"},
     {"optim.name": "adamw", "train.precision": "bf16-pure"},
     pytest.param({"optim.name": "adamw8bit"}, marks=pytest.mark.slow)],  # compiles: ~20 s
    ids=["adamw", "sgd", "bf16-pure-kahan", "adamw8bit"],
)  # fmt: skip
def test_the_disk_tier_equals_host_memory_bit_for_bit(tmp_path, over):
    """Same losses and weights with the states in files; every state tensor and weight copy
    is file-backed (8-bit AdamW's codes and scales included)."""
    if over.get("optim.name") == "adamw8bit":
        pytest.importorskip("torchao")
    ram = build(_cfg(None, **over), CPU, with_data=False)
    disk = build(_cfg(tmp_path, **over), CPU, with_data=False)
    assert _steps(ram, 3) == _steps(disk, 3)
    assert _same(ram, disk)
    tier = disk.optimizer.disk
    states = _state_tensors(disk.optimizer)
    assert states and all(tier.holds(t) for t in states)
    assert all(tier.holds(h) for h in disk.optimizer.grad_params)
    assert tier.nbytes() >= sum(t.numel() * t.element_size() for t in states)


def test_a_disk_tier_checkpoint_resumes_in_host_memory_and_back(tmp_path):
    straight = build(_cfg(None), CPU, with_data=False)
    expected = _steps(straight, 4)
    for first, then in [(tmp_path / "a", None), (None, tmp_path / "b")]:
        a = build(_cfg(first), CPU, with_data=False)
        _steps(a, 2)
        torch.save({"model": a.model.state_dict(), "optim": a.optimizer.state_dict()},
                   tmp_path / "ck.pt")  # fmt: skip
        b = build(_cfg(then), CPU, with_data=False)
        loaded = torch.load(tmp_path / "ck.pt", weights_only=True)
        b.model.load_state_dict(loaded["model"])
        b.optimizer.load_state_dict(loaded["optim"])
        if then is not None:  # loaded states went straight to the files
            assert all(b.optimizer.disk.holds(t) for t in _state_tensors(b.optimizer))
        assert _steps(b, 4, start=2) == expected[2:], (first, then)
        assert _same(b, straight)


def test_the_scratch_files_go_with_the_optimizer(tmp_path):
    tier = DiskTier(str(tmp_path))
    t = tier.tensor_like(torch.arange(10.0))
    assert torch.equal(t, torch.arange(10.0)) and tier.holds(t)
    folder = tier.dir
    assert any(folder.iterdir())
    del t, tier
    gc.collect()
    assert not folder.exists() and tmp_path.exists()


def test_a_disk_tier_needs_the_host_optimizer_and_a_writable_folder(tmp_path):
    with pytest.raises(ConfigError, match="memory.offload_dir"):
        load_config("tiny", overrides={"memory.offload_dir": str(tmp_path)})
    afile = tmp_path / "a-file"
    afile.write_text("")
    with pytest.raises(ConfigError, match="memory.offload_dir"):
        _cfg(afile)


def test_the_plan_puts_states_and_weight_copies_on_disk(tmp_path):
    from onegpu.plan.memory import plan_memory

    ram = plan_memory(_cfg(None)).memory
    disk = plan_memory(_cfg(tmp_path)).memory
    assert disk["peak"] == ram["peak"]
    assert disk["disk"] + disk["host"] == ram["host"]
    assert disk["disk"] > ram["params"]  # the states and the weight copies
    assert not any(tmp_path.iterdir())  # a plan makes no files
