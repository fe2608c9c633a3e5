"""Exact count of the bytes autograd keeps for backward (saved activations).

Every tensor saved for backward passes through `saved_tensors_hooks`, including the inputs that
non-reentrant checkpointing keeps. The one exception is selective checkpointing, whose saved op
outputs sit in a cache of its own: the caller passes `also_saved`, a function that lists such
tensors (the build wires `techniques.checkpointing.selective_cache_tensors`); it is sampled at
every save, so a cache is seen while forward fills it, before backward empties it.
Parameters are not activations and are left out; a storage saved twice while alive is counted
once (a later micro-batch's storage at a reused address counts again).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable

import torch
from torch import nn

from onegpu.memory.tracker import holder


class SavedTensorCounter:
    """Context manager: `with SavedTensorCounter(model) as c: loss = ...`; then c.bytes."""

    def __init__(
        self,
        model: nn.Module | None = None,
        also_saved: Callable[[], Iterable[torch.Tensor]] | None = None,
    ):
        self._param_storages = (
            {holder(p).untyped_storage()._cdata for p in model.parameters()}
            if model is not None
            else set()
        )
        self._also_saved = also_saved
        self._seen: set[int] = set()  # storages counted and still alive
        self.bytes = 0
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self.pack, lambda t: t)

    def _count(self, t: torch.Tensor) -> None:
        storage = holder(t).untyped_storage()  # a DTensor's: its local shard's
        key = storage._cdata  # the storage itself: works for real, meta and fake tensors
        if key in self._param_storages or key in self._seen:
            return
        self._seen.add(key)
        # forget it when freed: the next micro-batch may get a new storage at the same address
        weakref.finalize(t, self._seen.discard, key)
        self.bytes += storage.nbytes()

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        """The pack hook (public so that another pair of hooks can call it: hooks do not nest,
        only the innermost pair runs)."""
        self._count(t)
        if self._also_saved is not None:
            for cached in self._also_saved():
                self._count(cached)
        return t

    def __enter__(self) -> SavedTensorCounter:
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._hooks.__exit__(*exc)
