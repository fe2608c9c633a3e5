"""Exact count of the bytes autograd keeps for backward (saved activations).

Every tensor saved for backward passes through `saved_tensors_hooks`, including the inputs that
non-reentrant checkpointing keeps. The one exception is selective checkpointing, whose saved op
outputs sit in its own cache: it registers that cache here (`track_cache`) so it is counted too.
Parameters are not activations and are left out; a storage saved twice while alive is counted
once (a later micro-batch's storage at a reused address counts again).
"""

from __future__ import annotations

import weakref

import torch
from torch import nn


class SavedTensorCounter:
    """Context manager: `with SavedTensorCounter(model) as c: loss = ...`; then c.bytes."""

    def __init__(self, model: nn.Module | None = None):
        self._param_storages = (
            {p.untyped_storage()._cdata for p in model.parameters()} if model is not None else set()
        )
        self._seen: set[int] = set()  # storages saved and still alive
        self._caches: list[dict] = []
        self._bytes = 0
        self._frozen: int | None = None
        self.count = 0
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        key = storage._cdata  # the storage itself: works for real, meta and fake tensors
        if key in self._param_storages or key in self._seen:
            return t
        self._seen.add(key)
        # forget it when freed: the next micro-batch may get a new storage at the same address
        weakref.finalize(t, self._seen.discard, key)
        self._bytes += storage.nbytes()
        self.count += 1
        return t

    def track_cache(self, cache: dict | None) -> None:
        if cache is not None:
            self._caches.append(cache)

    @property
    def bytes(self) -> int:
        """Saved bytes: hooked tensors plus selective-checkpoint caches (frozen at exit, since
        backward empties those caches)."""
        if self._frozen is not None:
            return self._frozen
        total = self._bytes
        for t in self._cached_tensors():
            storage = t.untyped_storage()
            if storage._cdata not in self._param_storages and storage._cdata not in self._seen:
                total += storage.nbytes()
        return total

    def _cached_tensors(self):
        seen: set[int] = set()
        for cache in self._caches:
            for outputs in cache.values():
                for leaf in torch.utils._pytree.tree_leaves(outputs):
                    t = getattr(leaf, "val", leaf)  # torch wraps cached outputs in _VersionWrapper
                    if isinstance(t, torch.Tensor) and id(t) not in seen:
                        seen.add(id(t))
                        yield t

    def __enter__(self) -> SavedTensorCounter:
        ACTIVE_COUNTERS.append(self)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._hooks.__exit__(*exc)
        ACTIVE_COUNTERS.remove(self)
        self._frozen = self.bytes


ACTIVE_COUNTERS: list[SavedTensorCounter] = []
"""Counters open now; selective checkpointing reports its caches to them."""
