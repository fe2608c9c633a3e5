import os
import tempfile

import pytest
import torch

# A cache private to this test session: token files and measured peaks are made fresh once,
# never read from a developer's ~/.cache.
_CACHE = tempfile.mkdtemp(prefix="onegpu-test-cache-")
os.environ["ONEGPU_CACHE"] = _CACHE


@pytest.fixture(autouse=True)
def _deterministic():
    torch.manual_seed(0)
    yield


@pytest.fixture
def tiny_cfg():
    from onegpu.config import load_config

    return load_config("tiny", overrides={"train.device": "cpu", "out.progress": "false"})
