"""Live tensor bytes of a computation, followed op by op: works on the meta device.

Every tensor an op returns is attributed to its storage; a storage is allocated when first
seen and freed when the last tensor viewing it dies (`weakref.finalize`: PyTorch keeps a
tensor's Python object alive while C++ still holds the tensor, e.g. saved for backward, so
the finalizer fires when the memory would really be released). On the meta device nothing is
allocated, yet the sizes and lifetimes are those of the real run: this is how `onegpu plan`
predicts peak memory without a GPU. On a real device the same numbers can be checked against
the profiler's memory timeline.
"""

from __future__ import annotations

import functools
import weakref
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


def _storage_key(t: torch.Tensor) -> tuple[int, int]:
    s = holder(t).untyped_storage()
    return s._cdata, s.nbytes()


def holder(t: torch.Tensor) -> torch.Tensor:
    """The tensor that holds `t`'s memory: a DTensor's local shard, an asynchronous collective's
    result (wrappers whose own storage is empty); `t` itself otherwise. Called for every tensor
    of every op the trackers follow: plain and fake tensors leave at the first test."""
    while isinstance(t, _wrappers()):
        t = t._local_tensor if hasattr(t, "_local_tensor") else t.elem
    return t


@functools.cache
def _wrappers() -> tuple[type, ...]:
    from torch.distributed._functional_collectives import AsyncCollectiveTensor
    from torch.distributed.tensor import DTensor

    return DTensor, AsyncCollectiveTensor


class LiveTensorBytes(TorchDispatchMode):
    """Tracks bytes of live storages created inside the mode; `peak` and a snapshot of which
    storages were alive at the peak (to be labelled afterwards: params, grads, saved ...)."""

    def __init__(self) -> None:
        super().__init__()
        self._refs: dict[int, int] = {}  # storage id -> live tensors viewing it
        self.sizes: dict[int, int] = {}  # storage id -> bytes, for storages alive now
        self.current = 0
        self.peak = 0
        self.peak_storages: dict[int, int] = {}  # allocation number -> bytes, at the peak
        # storage id -> allocation number: ids are addresses and get reused after a free, so
        # anything labelled later (gradients, saved tensors) is matched by allocation number
        self.serials: dict[int, int] = {}
        self._next_serial = 0
        self._external: dict[int, torch.UntypedStorage] = {}

    def _release(self, sid: int) -> None:
        n = self._refs[sid] - 1
        if n:
            self._refs[sid] = n
            return
        del self._refs[sid]
        del self.serials[sid]
        self.current -= self.sizes.pop(sid)

    def track(self, t: torch.Tensor) -> None:
        t = holder(t)
        sid, nbytes = _storage_key(t)
        if sid in self._refs:
            self._refs[sid] += 1
        else:
            self._refs[sid] = 1
            self.sizes[sid] = nbytes
            self.serials[sid] = self._next_serial
            self._next_serial += 1
            self.current += nbytes
            if self.current > self.peak:
                self.peak = self.current
                self.peak_storages = self.live_by_serial()
        weakref.finalize(t, self._release, sid)

    def live_by_serial(self) -> dict[int, int]:
        """Bytes of each live storage, keyed by allocation number."""
        return {self.serials[sid]: n for sid, n in self.sizes.items()}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None) -> Any:
        # Storages that reach an op without having been made inside the mode (parameters,
        # inputs, optimizer states) exist already: views of them allocate nothing.
        for t in tree_flatten((args, kwargs))[0]:
            if isinstance(t, torch.Tensor):
                sid = storage_id(t)
                if sid not in self._refs and sid not in self._external:
                    # hold it: a freed storage's address could be reused by a new allocation
                    self._external[sid] = holder(t).untyped_storage()
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and storage_id(t) not in self._external:
                self.track(t)
        return out


def storage_id(t: torch.Tensor) -> int:
    return holder(t).untyped_storage()._cdata
