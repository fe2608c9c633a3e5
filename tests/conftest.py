import os
import tempfile

import pytest
import torch

# A cache private to this test session: token files and measured peaks are made fresh once,
# never read from a developer's ~/.cache.
_CACHE = tempfile.mkdtemp(prefix="onegpu-test-cache-")
os.environ["ONEGPU_CACHE"] = _CACHE


@pytest.fixture(autouse=True, scope="session")
def _small_matmul_peaks():
    """MFU's denominator is measured once per machine (a 4096^3 matmul per dtype: ~15 s on a
    slow core). No test checks MFU's value, so the session measures it at 512^3: real figures,
    a second instead of a minute."""
    from onegpu.perf.devices import cpu_peak_flops

    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        cpu_peak_flops(dtype, n=512)


@pytest.fixture(autouse=True)
def _deterministic():
    torch.manual_seed(0)
    yield


@pytest.fixture
def tiny_cfg():
    from onegpu.config import load_config

    return load_config("tiny", overrides={"train.device": "cpu", "out.progress": "false"})
