"""Asynchronous adapter loads on CUDA: the host -> device copy on a side stream, one event per load.

A synchronous copy on the step thread (an 8B model's rank-16 adapter on all seven targets is
84 MB, a few milliseconds over PCIe) would stall every running request for its length. Instead
`AsyncLoads.start` reserves the adapter's room in the pool (`residency.reserve`), queues the copy
from the host tier's pinned buffer on a side stream and records an event; `finished()`, called by
the tiers' `poll` between steps, commits the loads whose event has completed (`Event.query`,
never a wait), and only then can a step plan name the adapter's slot. So:

- No step reads a slot before its bytes are written: the slot table gains the adapter only after
  the host has seen the event complete, and work that has completed is visible to every kernel
  queued later, on any stream of the device. The slot itself (and its entry in the slot table,
  hence in the kernels' pointer tables at the next step's sync) is claimed as soon as the copy
  is queued: nothing names it before the commit, so that update overlaps the copy.
- No step waits for a copy: nothing on the step stream waits for the side stream.
- The side stream waits for the step stream's work queued so far before it copies: the reserved
  bytes may have belonged to an adapter just evicted (or moved by a compaction) that a step still
  queued on the GPU reads.
- The host buffers stay alive until the event completes (held here; the host tier may drop its
  entry meanwhile), and the pool's buffer, allocated on the step stream, is marked used by the
  side stream (`record_stream`) so the caching allocator never reuses it under a running copy.
- Reserved extents are *in flight* in the pool, and no compaction moves them (device_pool.py).

On the CPU there is no copy engine to overlap with: the tiers place loads synchronously between
steps (store reads run on the loader thread) and this module is not used. The copier is
injectable, so the bookkeeping is tested on the CPU with events completed by hand.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch

from loraplex.adapters.residency import AdapterResidency
from loraplex.lora.weights import AdapterWeights

_WAIT_POLL_S = 0.0002  # CUDA events have no timed wait: `wait` polls at this interval
_LATENCIES_KEPT = 1024


class CopyEvent(Protocol):
    def query(self) -> bool: ...
    def synchronize(self) -> None: ...


class Copier(Protocol):
    def copy(self, dst: AdapterWeights, src: AdapterWeights) -> CopyEvent: ...


def packed_spans(dst: AdapterWeights, src: AdapterWeights) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(dst, src) as two 1-D tensors over their whole extents when `src` is laid out exactly like
    `dst` in one storage (the host tier packs its copies so), so the load is one copy; else None.
    The alignment gaps between tensors are copied too: both extents own those bytes."""
    keys = list(dst.pairs)
    d_ts = [t for k in keys for t in (dst.pairs[k].a, dst.pairs[k].b)]
    s_ts = [t for k in keys for t in (src.pairs[k].a, src.pairs[k].b)]
    if not d_ts:
        return None
    s_store, d_store = s_ts[0].untyped_storage(), d_ts[0].untyped_storage()
    for s, d in zip(s_ts, d_ts, strict=True):
        if (
            s.dtype != d.dtype
            or not s.is_contiguous()
            or s.untyped_storage().data_ptr() != s_store.data_ptr()
        ):
            return None
    s0, d0 = min(t.data_ptr() for t in s_ts), min(t.data_ptr() for t in d_ts)
    if any(s.data_ptr() - s0 != d.data_ptr() - d0 for s, d in zip(s_ts, d_ts, strict=True)):
        return None
    elem = d_ts[0].element_size()
    n = max(t.data_ptr() + t.numel() * elem for t in d_ts) - d0
    s_off, d_off = s0 - s_store.data_ptr(), d0 - d_store.data_ptr()
    if s_off + n > s_store.nbytes() or d_off + n > d_store.nbytes():
        return None
    dtype = d_ts[0].dtype
    d_flat = torch.empty(0, dtype=dtype, device=d_ts[0].device).set_(
        d_store, d_off // elem, (n // elem,), (1,)
    )
    s_flat = torch.empty(0, dtype=dtype).set_(s_store, s_off // elem, (n // elem,), (1,))
    return d_flat, s_flat


def copy_weights(dst: AdapterWeights, src: AdapterWeights, non_blocking: bool) -> None:
    """Copy `src` into `dst` (same keys and shapes): one copy when both are packed alike."""
    d, s = dst.packed, src.packed
    if d is not None and s is not None and d.shape == s.shape and d.dtype == s.dtype:
        # both are whole extents of one layout (the pool's views of the room reserved for `src`,
        # and the host tier's copy): one span, no per-tensor checks
        d.copy_(s, non_blocking=non_blocking)
        return
    spans = packed_spans(dst, src)
    if spans is not None:
        spans[0].copy_(spans[1], non_blocking=non_blocking)
        return
    for key, pair in dst.pairs.items():
        pair.a.copy_(src.pairs[key].a, non_blocking=non_blocking)
        pair.b.copy_(src.pairs[key].b, non_blocking=non_blocking)


class StreamCopier:
    """Copies on a side CUDA stream of `device`; `buffer` is the pool the copies write into."""

    def __init__(self, device: torch.device, buffer: torch.Tensor) -> None:
        self.device = device
        self.stream = torch.cuda.Stream(device)  # type: ignore[no-untyped-call]  # torch: unannotated
        buffer.record_stream(self.stream)
        # Queued on the side stream before each copy; tests put a long GPU sleep here so that a
        # load is still in flight across many steps.
        self.before_copy: Callable[[], None] | None = None

    def copy(self, dst: AdapterWeights, src: AdapterWeights) -> torch.cuda.Event:
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            if self.before_copy is not None:
                self.before_copy()
            copy_weights(dst, src, non_blocking=True)
            event = torch.cuda.Event()  # type: ignore[no-untyped-call]  # torch: unannotated
            event.record(self.stream)
        return event


@dataclass
class _Load:
    source: AdapterWeights  # kept alive until the copy has completed
    event: CopyEvent
    nbytes: int
    started: float


class AsyncLoads:
    """Loads in flight: reserved in the pool, copying on the side stream, committed when done."""

    def __init__(
        self,
        residency: AdapterResidency,
        copier: Copier,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        self.residency = residency
        self.copier = copier
        self.clock = clock
        self._loads: dict[str, _Load] = {}
        # (bytes, seconds from `start` until the slot was usable) of recent loads, newest last
        self.latencies: deque[tuple[int, float]] = deque(maxlen=_LATENCIES_KEPT)

    def __contains__(self, revision: str) -> bool:
        return revision in self._loads

    def __len__(self) -> int:
        return len(self._loads)

    def revisions(self) -> list[str]:
        return list(self._loads)

    def start(self, revision: str, weights: AdapterWeights) -> None:
        """Reserve room for `revision` (the caller has made it; PoolFullError changes nothing)
        and queue the copy of `weights` (host, the pool's dtype) into it."""
        started = self.clock()
        room = self.residency.reserve(revision, weights)
        pool = self.residency.pool
        assert pool is not None and room.packed is not None
        src = weights.packed
        one_span = src is not None and src.shape == room.packed.shape and src.dtype == room.packed.dtype
        try:
            # A host copy packed like the extent is copied as one span; anything else pair by pair.
            event = self.copier.copy(room if one_span else pool.weights(revision), weights)
        except BaseException:
            self.residency.unreserve(revision)
            raise
        # While the copy runs: the slot and its slot-table entry, so the next step's sync of the
        # kernels' tables points them at the extent before the copy completes (no step can name
        # the slot until `commit`), leaving the commit mere bookkeeping.
        self.residency.claim_slot(revision)
        self._loads[revision] = _Load(weights, event, weights.nbytes, started)

    def finished(self) -> list[str]:
        """Commit every load whose copy has completed (now resident); returns their revisions.
        On the step thread, between steps."""
        done = [r for r, load in self._loads.items() if load.event.query()]
        for revision in done:
            load = self._loads.pop(revision)
            self.residency.commit(revision)
            self.latencies.append((load.nbytes, self.clock() - load.started))
        return done

    def wait(self, timeout: float) -> None:
        """Return once some load's copy has completed, or after `timeout` seconds."""
        deadline = time.monotonic() + timeout
        while self._loads and not any(load.event.query() for load in self._loads.values()):
            if time.monotonic() >= deadline:
                return
            time.sleep(_WAIT_POLL_S)

    def cancel(self, revision: str) -> None:
        """Forget a load (its revision was retired): wait for its copy, give the room back."""
        load = self._loads.pop(revision, None)
        if load is not None:
            load.event.synchronize()  # the copy still writes the reserved bytes until then
            self.residency.unreserve(revision)


def build_async_loads(residency: AdapterResidency, device: torch.device) -> AsyncLoads | None:
    """Side-stream loads on CUDA; None elsewhere (the tiers then load synchronously)."""
    if device.type != "cuda" or residency.pool is None:
        return None
    return AsyncLoads(residency, StreamCopier(device, residency.pool.buffer))
