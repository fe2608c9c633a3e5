"""The staging ring of the host optimizer: bounded, first in first out, and a stretch is never
handed out while a copy still holds it."""

import random

import pytest
import torch

from onegpu.offload.staging_ring import StagingRing


def test_the_ring_lands_its_oldest_copies_to_make_room_and_never_overlaps_a_held_one():
    ring = StagingRing(100, pin=False)
    base = ring._buffer.data_ptr()
    held: dict[int, tuple[int, int]] = {}  # copy number -> byte range still in use
    landed: list[int] = []
    rng = random.Random(0)
    for i in range(300):
        n = rng.randint(1, 50)
        view = ring.take(n, torch.uint8)
        start = view.data_ptr() - base
        assert start >= 0 and start + n <= 100  # inside the ring
        for a, b in held.values():  # no stretch still held is handed out again
            assert start + n <= a or b <= start
        held[i] = (start, start + n)
        ring.hold(lambda i=i: (landed.append(i), held.pop(i)))
        assert ring.in_use() <= 100
    assert landed == sorted(landed)  # oldest first
    ring.drain()
    assert landed == list(range(300)) and ring.in_use() == 0


def test_views_have_the_gradient_dtype_and_size_and_a_gradient_larger_than_the_ring_is_refused():
    ring = StagingRing(256, pin=False)
    view = ring.take(11, torch.bfloat16)  # 22 bytes: the next stretch still starts aligned
    assert view.dtype == torch.bfloat16 and view.numel() == 11
    ring.hold(lambda: None)
    after = ring.take(3, torch.float32)
    assert after.data_ptr() % 64 == 0 and after.numel() == 3
    ring.hold(lambda: None)
    with pytest.raises(ValueError, match="does not fit"):
        ring.take(65, torch.float32)
