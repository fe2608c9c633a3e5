"""--gpu names an entry of the GPU table however a user writes it, or says why not."""

from __future__ import annotations

import pytest

from onegpu.config import ConfigError
from onegpu.perf.devices import table_gpu


@pytest.mark.parametrize(
    "written, name",
    [("H200-141", "H200-141"), ("h200", "H200-141"), ("rtx4090", "RTX4090"),
     ("H100", "H100-80"), ("NVIDIA H100 80GB HBM3", "H100-80"),
     ("NVIDIA GeForce RTX 4090", "RTX4090"), ("nvidia h100 80gb hbm3", "H100-80"),
     ("NVIDIA A100-SXM4-80GB", "A100-80"), ("NVIDIA A100-SXM4-40GB", "A100-40"),
     ("Tesla V100-PCIE-32GB", "V100-32")],
)  # fmt: skip
def test_a_gpu_is_found_by_any_name_that_means_one_entry(written, name):
    assert table_gpu(written) == name


@pytest.mark.parametrize(
    "written, says",
    [
        ("A100", "one of A100-40, A100-80: name one"),
        ("A100-41", "unknown GPU 'A100-41'"),
        ("NVIDIA A100", "one of A100-40, A100-80: name one"),
    ],
)
def test_a_gpu_name_that_means_several_entries_or_none_is_refused(written, says):
    with pytest.raises(ConfigError, match=says):
        table_gpu(written)
