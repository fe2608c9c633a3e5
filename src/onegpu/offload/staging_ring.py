"""A bounded ring of pinned host memory through which gradients leave the device.

The host optimizer (`memory.offload_optimizer`) copies each gradient to the host on a side
stream as backward produces it. The copy needs a pinned destination (a pageable one makes the
copy synchronous), and a pinned buffer per parameter costs as much host memory as the
gradients themselves: 15 GiB for an 8B model in bf16. The ring holds a fixed number of bytes
(twice the largest gradient, so one copy can land while the next is in flight); a gradient
takes the next stretch of it, and when none is free the oldest copies are landed (added into
their accumulation buffers, or stepped) first, in the order they were made. That also bounds
the gradients alive on the device: a device gradient lives until its copy is done, and no
copy starts before the ring has room for it.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

import torch

ALIGN = 64
"""Bytes each stretch is rounded up to: a bf16 gradient of odd length never misaligns the
fp32 one after it."""

Land = Callable[[], None]
"""Finishes one copy: waits for it and uses the staged bytes (after which they may be reused)."""


class StagingRing:
    """`take(numel, dtype)` returns a view of the ring for a gradient, landing the oldest
    copies first where the ring is full; `hold(land)` records how the view just taken is
    finished; `drain()` finishes them all."""

    def __init__(self, capacity: int, *, pin: bool):
        self.capacity = capacity
        self._buffer = torch.empty(capacity, dtype=torch.uint8, pin_memory=pin)
        self._head = 0  # where the next stretch starts
        self._held: deque[tuple[int, int, Land | None]] = deque()  # (start, bytes, land)

    def take(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        size = numel * torch.empty((), dtype=dtype).element_size()
        nbytes = -(-size // ALIGN) * ALIGN  # every stretch starts aligned for any dtype
        if nbytes > self.capacity:
            raise ValueError(f"a {size}-byte gradient does not fit a {self.capacity}-byte ring")
        start = self._room_for(nbytes)
        self._held.append((start, nbytes, None))
        self._head = start + nbytes
        return self._buffer[start : start + size].view(dtype)

    def hold(self, land: Land) -> None:
        """How the stretch taken last is finished (its copy waited for and its bytes used)."""
        start, nbytes, _ = self._held.pop()
        self._held.append((start, nbytes, land))

    def drain(self) -> None:
        """Finish every copy in the ring, oldest first."""
        while self._held:
            self._land_oldest()

    def _room_for(self, nbytes: int) -> int:
        """Where `nbytes` contiguous bytes start, landing the oldest copies until they are
        free: after the newest stretch, or from the ring's start once the end is too short."""
        while True:
            if not self._held:
                self._head = 0
                return 0
            oldest = self._held[0][0]
            if self._head > oldest:  # the held stretch is [oldest, head): room after it
                if self._head + nbytes <= self.capacity:
                    return self._head
                if nbytes <= oldest:  # wrap to the start
                    return 0
            elif self._head + nbytes <= oldest:  # wrapped: room between head and oldest
                return self._head
            self._land_oldest()

    def _land_oldest(self) -> None:
        _, _, land = self._held.popleft()
        if land is not None:
            land()

    def in_use(self) -> int:
        """Bytes held by copies not yet finished."""
        return sum(n for _, n, _ in self._held)
