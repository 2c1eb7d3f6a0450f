"""The host-memory tier: adapter weights kept in host memory between the store and the device pool.

Entries are revisions' weights in the engine's dtype on the CPU, packed in one buffer per revision
in the device pool's extent layout (pinned when the device is CUDA, so a host -> device copy can
run asynchronously, as one copy). They arrive when an
adapter is evicted from the device (so it reloads without reading the store) or fetched from the
store (so the next eviction drops it for free), and leave least recently used first once the byte
budget is exceeded.

A *kept* entry is never dropped: an adapter registered in-process with no store behind it has no
other copy, so dropping it would lose it. Kept entries count toward the bytes used; if they alone
exceed the budget the tier stays over budget (reported) rather than lose data.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import torch

from loraplex.lora.packed import PackedViews, pack_layout, packed_weights
from loraplex.lora.weights import AdapterWeights


@dataclass
class _Entry:
    weights: AdapterWeights
    nbytes: int
    kept: bool


class HostCache:
    def __init__(self, budget_bytes: int, dtype: torch.dtype, pin: bool = False) -> None:
        if budget_bytes < 0:
            raise ValueError(f"host adapter cache budget must be >= 0 bytes, got {budget_bytes}")
        self.budget_bytes = budget_bytes
        self.dtype = dtype
        self.pin = pin
        self._entries: OrderedDict[str, _Entry] = OrderedDict()  # least recently used first
        self.used_bytes = 0
        self.hits = 0
        self.misses = 0
        self.dropped = 0

    def __contains__(self, revision: str) -> bool:
        return revision in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def revisions(self) -> list[str]:
        return list(self._entries)

    def host_copy(self, weights: AdapterWeights) -> AdapterWeights:
        """`weights` as this tier stores them: CPU, the engine's dtype, owned storage (never a view
        of the device pool, whose bytes move), pinned when asked. All pairs sit in one buffer laid
        out as the device pool lays out an extent, so a load is one host -> device copy (and one
        pinned allocation) instead of two per (layer, target)."""
        elem = torch.empty(0, dtype=self.dtype).element_size()
        lay = pack_layout(weights, elem)
        flat = torch.empty(lay.size // elem, dtype=self.dtype, pin_memory=self.pin)
        copy = packed_weights(flat, 0, lay)
        if weights.packed is not None and weights.layout is lay:  # packed alike (a pool extent): one copy
            flat.copy_(weights.packed)
            return copy
        views = copy.pairs
        for key, p in views.items():  # copy_ converts device and dtype
            p.a.copy_(weights.pairs[key].a.detach())
            p.b.copy_(weights.pairs[key].b.detach())
        if isinstance(views, PackedViews):
            # Only the copy needed them: a load copies the one packed span, and a cached adapter
            # kept with its views would be ~3 tracked objects a pair for every full GC pass.
            views.forget()
        return copy

    def put(self, revision: str, weights: AdapterWeights, keep: bool = False) -> AdapterWeights:
        """Store a host copy of `weights` under `revision` (refreshing its recency when present;
        `keep` only ever turns on) and drop unkept entries, least recently used first, until the
        tier is within its budget. Returns the stored weights."""
        entry = self._entries.get(revision)
        if entry is None:
            copy = self.host_copy(weights)
            entry = _Entry(copy, copy.nbytes, keep)
            self._entries[revision] = entry
            self.used_bytes += entry.nbytes
        else:
            entry.kept = entry.kept or keep
            self._entries.move_to_end(revision)
        self._shrink(protect=revision)
        return entry.weights

    def get(self, revision: str) -> AdapterWeights | None:
        """The stored weights (counted as a hit, and now the most recently used) or None (a miss)."""
        entry = self._entries.get(revision)
        if entry is None:
            self.misses += 1
            return None
        self.hits += 1
        self._entries.move_to_end(revision)
        return entry.weights

    def drop(self, revision: str) -> None:
        """Forget `revision`, kept or not (it was retired)."""
        entry = self._entries.pop(revision, None)
        if entry is not None:
            self.used_bytes -= entry.nbytes

    def is_kept(self, revision: str) -> bool:
        entry = self._entries.get(revision)
        return entry is not None and entry.kept

    def _shrink(self, protect: str) -> None:
        if self.used_bytes <= self.budget_bytes:
            return
        for revision in list(self._entries):
            if self.used_bytes <= self.budget_bytes:
                break
            entry = self._entries[revision]
            if entry.kept or revision == protect:
                continue
            del self._entries[revision]
            self.used_bytes -= entry.nbytes
            self.dropped += 1
        # An entry just put stays even past the budget when the rest cannot make room: it is about
        # to be placed on the device, and the next put drops it first.

    def stats(self) -> dict[str, int]:
        return {
            "adapters": len(self._entries),
            "kept": sum(e.kept for e in self._entries.values()),
            "used_bytes": self.used_bytes,
            "budget_bytes": self.budget_bytes,
            "hits": self.hits,
            "misses": self.misses,
            "dropped": self.dropped,
        }
