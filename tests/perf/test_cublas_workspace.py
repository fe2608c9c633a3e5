"""A GPU step holds one cuBLAS workspace per thread that runs matmuls (the step's and autograd's),
allocated through the caching allocator: `max_memory_allocated` counts them, so a GPU plan does."""

from __future__ import annotations

import dataclasses
import subprocess
import sys

import pytest
import torch

from onegpu.config import load_config
from onegpu.perf.devices import CUBLAS_HANDLES, GPUS, cublas_workspace_bytes
from onegpu.plan.memory import plan_memory
from onegpu.plan.targets import gpu_caps

MiB = 2**20


@pytest.mark.parametrize(
    "capability, config, nbytes",
    [((9, 0), None, 32 * MiB), ((10, 0), None, 32 * MiB), ((8, 9), None, 8 * MiB + 128 * 1024),
     ((8, 0), None, 8 * MiB + 128 * 1024), ((9, 0), ":4096:2:16:8", 8 * MiB + 128 * 1024),
     ((8, 0), ":4096:8", 32 * MiB), ((9, 0), ":16:8", 128 * 1024)],
)  # fmt: skip
def test_the_workspace_is_torchs_for_the_capability_or_cublas_workspace_config(
    monkeypatch, capability, config, nbytes
):
    if config is None:
        monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    else:
        monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", config)
    assert cublas_workspace_bytes(capability) == nbytes


def test_every_table_gpu_names_its_capability():
    """Hopper's workspace is 4x the others': a table entry left at the default would plan it
    wrong."""
    hopper = {name for name, spec in GPUS.items() if spec.capability == (9, 0)}
    assert hopper == {"H100-80", "H200-141"}
    assert GPUS["RTX4090"].capability == (8, 9) and GPUS["T4"].capability == (7, 5)


def test_a_gpu_plan_counts_the_workspaces_of_both_threads(monkeypatch):
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    cfg = load_config("tiny", overrides={"model.dropout": "0", "train.batch_size": "4"})
    caps = gpu_caps("H100-80")
    assert caps.blas_workspace == 32 * MiB
    bare = plan_memory(cfg, "cuda", dataclasses.replace(caps, blas_workspace=0))
    plan = plan_memory(cfg, "cuda", caps)
    held = CUBLAS_HANDLES * 32 * MiB
    assert plan.memory["peak"] - bare.memory["peak"] == held
    assert plan.memory["other"] - bare.memory["other"] == held
    on_cpu = plan_memory(cfg, "cpu")
    assert on_cpu.memory["other"] < held  # a CPU plan holds no workspace


FRESH_PROCESS = """
import torch
from onegpu.techniques.precision import device_caps
device = torch.device("cuda")
w = torch.randn(256, 256, device=device, requires_grad=True)
x = torch.randn(64, 256, device=device)
torch.cuda.synchronize()
before = torch.cuda.memory_allocated()
y = x @ w
torch.cuda.synchronize()
forward = torch.cuda.memory_allocated() - before - y.untyped_storage().nbytes()
y.sum().backward()
del y
torch.cuda.synchronize()
held = torch.cuda.memory_allocated() - before - w.grad.untyped_storage().nbytes()
print(device_caps(device).blas_workspace, forward, held)
"""


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_a_gpu_the_forward_and_backward_threads_each_hold_one_workspace():
    """In a fresh process, the first matmul in forward and the first in backward each allocate
    one workspace of the rule's size, and both stay allocated."""
    out = subprocess.run(
        [sys.executable, "-c", FRESH_PROCESS], capture_output=True, text=True, check=True
    ).stdout
    nbytes, forward, held = (int(v) for v in out.split()[-3:])
    assert forward == nbytes
    assert held == CUBLAS_HANDLES * nbytes
