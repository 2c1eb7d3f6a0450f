"""Device-side copy of the slot table: per (layer, target), slot -> (A, B, rank, scale).

A and B are element offsets from one base buffer (`LoRADeviceTable.base`), so a kernel turns
them into pointers that the compiler knows are 16-byte aligned. The kernels read weights
through these tables, so every adapter stays at its own rank: nothing
is padded, and adapters of different ranks share one launch. The tables change only when
`LoRASlotTable.version` does (an adapter loaded into or cleared from a slot), never per step.

An update touches only the slots that changed since the last one (`LoRASlotTable.changed_since`):
their columns are written on the host (`lora/triton_entries.py`; for an adapter in the device
pool, from its extent's address and its layout's per-pair offsets, with no Python work per
(layer, target)), then copied to the device as one small host -> device copy of those columns
and scattered into the tables on the current stream, so every step queued after it reads the
new columns and every step queued before it the old ones. A first sync, another slot table, a
slot past the capacity or another dtype rebuilds every column (one copy of the whole tables).

CUDA graphs record these tables' addresses, so an update writes into the same device tensors
whenever they are large enough (the capacity grows in powers of two); `epoch` counts the times
they had to be reallocated, which invalidates captured graphs. Every rank in the tables is a
multiple of 8 (`padded_pair`), so no adapter's rank changes what the kernels compile. The last
slot column is the *null slot* (rank 0 everywhere): the empty segments of a captured step point
at it, so they read no weights.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from loraplex.lora.layout import GROUP_SLICES, TARGETS, pair_row
from loraplex.lora.triton_entries import (
    ENTRY_BYTES,
    HostTables,
    SlotEntries,
    kernel_ready,
    packed_entries,
    pair_entries,
    table_views,
    weight_dtypes,
)
from loraplex.lora.weights import LoRASlotTable

_kernel_ready = kernel_ready  # the name the pool's tests use


def target_bit(layer: int, target: str) -> int:
    """Bit of (layer, target) in a slot's coverage mask."""
    return 1 << pair_row(layer, target)


@dataclass(frozen=True)
class GroupTables:
    """Views of one (layer, group): [n_slices, n_slots] each, slices in GROUP_SLICES order."""

    a_offs: torch.Tensor  # int64 element offsets from LoRADeviceTable.base
    b_offs: torch.Tensor  # int64
    ranks: torch.Tensor  # int32
    scales: torch.Tensor  # float32


class LoRADeviceTable:
    """Address/rank/scale tables of every (layer, target) and slot, on one device."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._source: LoRASlotTable | None = None
        self.version = -1
        self.epoch = 0  # bumped when the tables below are reallocated (see the module docstring)
        self.dtype: torch.dtype | None = None
        self.base = torch.empty(0)  # weights' dtype; every table entry is an offset from here
        self.n_slots = 0  # columns of the tables (capacity; the last is the null slot)
        self._host = HostTables(0, 0)
        self._buf = torch.empty(0, dtype=torch.uint8)  # the four tables on the device, one buffer
        self._a = self._b = self._r = self._s = torch.empty(0)
        self._views: dict[tuple[int, str], GroupTables] = {}  # slicing costs microseconds per call
        self._dims: tuple[int, dict[tuple[int, str], tuple[int, int]]] = (-1, {})
        self.uploads = 0  # host -> device copies of the tables (tests count them)

    @property
    def slot_coverage(self) -> dict[int, int]:
        """slot -> OR of target_bit over its pairs."""
        return self._host.coverage

    @property
    def slot_max_rank(self) -> dict[int, int]:
        return self._host.max_rank

    @property
    def dims(self) -> dict[tuple[int, str], tuple[int, int]]:
        """(layer, target) -> (d_in, d_out) of the adapted ones (made again only when that set
        changes)."""
        if self._dims[0] != self._host.dims_version:
            self._dims = (self._host.dims_version, self._host.dims())
        return self._dims[1]

    def sync(self, table: LoRASlotTable) -> None:
        """Bring the tables up to `table` (only the changed slots' columns when it is the table
        synced last); free when nothing changed. On an error the tables are as they were and the
        next call rebuilds them."""
        if table is self._source and table.version == self.version:
            return
        changed = table.changed_since(self.version) if table is self._source else None
        self._source = None  # until done: an error leaves the next call a whole rebuild
        if changed is None or not self._update(table, changed):
            self._rebuild(table)
        self._source = table
        self.version = table.version

    def _entries(self, slot: int, table: LoRASlotTable, host: HostTables) -> SlotEntries:
        weights = table.weights(slot)
        return packed_entries(weights, self.base) or pair_entries(slot, weights, self.base, host.padded())

    def _update(self, table: LoRASlotTable, changed: list[int]) -> bool:
        """Rewrite the columns of the `changed` slots in place; False (nothing done) when the
        tables must be rebuilt instead."""
        slots = sorted(set(changed))
        host = self._host
        for slot in slots:
            if slot in table:
                dtypes = weight_dtypes(table.weights(slot))
                if slot + 2 > self.n_slots or (dtypes and dtypes != {self.base.dtype}):
                    return False
        new = {slot: self._entries(slot, table, host) for slot in slots if slot in table}
        undo = {slot: host.entries[slot] for slot in slots if slot in host.entries}
        for slot in slots:
            host.take(slot)
        try:
            for slot, entries in new.items():
                host.put(slot, entries)
        except ValueError:
            for slot in slots:  # the host tables as they were; the device ones were not touched
                host.take(slot)
            for slot, entries in undo.items():
                host.put(slot, entries)
            raise
        self._upload_columns(slots)
        return True

    def _rebuild(self, table: LoRASlotTable) -> None:
        items = table.items()
        n_rows = table.num_layers * len(TARGETS)
        needed = max(max((slot for slot, _ in items), default=-1) + 2, table.capacity + 1)  # + the null slot
        dtypes = set().union(*(weight_dtypes(w) for _, w in items))
        if len(dtypes) > 1:
            raise ValueError(f"LoRA weights mix dtypes {sorted(map(str, dtypes))}; the kernels need one")
        dtype = dtypes.pop() if dtypes else (self.dtype or table.dtype or torch.float32)
        realloc = needed > self.n_slots or self._host.n_rows != n_rows or self.base.dtype != dtype
        if realloc:
            n_slots = max(16, 1 << (needed - 1).bit_length())
            # Absent entries (offset 0, rank 0) point at the base itself, a real buffer: no load is
            # ever issued for them (rank 0 masks everything), but no pointer is ever null either.
            base = torch.zeros(64, dtype=dtype, device=self.device)
        else:
            n_slots, base = self.n_slots, self.base
        host = HostTables(n_rows, n_slots)
        reuse = self._host.padded()  # the padded copies of odd-rank pairs, made before
        for slot, weights in items:
            host.put(slot, packed_entries(weights, base) or pair_entries(slot, weights, base, reuse))
        if realloc:
            self.epoch += 1
            self.n_slots = n_slots
            self._buf = torch.empty(host.buf.shape, dtype=torch.uint8, device=self.device)
            self._a, self._b, self._r, self._s = table_views(self._buf, n_rows, n_slots)
            self._views = {}
        self.dtype, self.base = (dtype if items or table.dtype is not None else self.dtype), base
        self._host = host
        self._dims = (-1, {})
        # in place when not reallocated: captured graphs keep reading these tensors
        self._buf.copy_(self._staged(host.buf), non_blocking=True)
        self.uploads += 1

    def _upload_columns(self, slots: list[int]) -> None:
        """Copy the columns of `slots` from the host tables to the device ones: one host -> device
        copy of [columns x the four tables, then the slot ids], four scatters on the device."""
        live = [s for s in slots if s < self.n_slots]
        if not live:
            return
        host, k, n_rows = self._host, len(live), self._host.n_rows
        staged = torch.empty(n_rows * k * ENTRY_BYTES + 8 * k, dtype=torch.uint8, pin_memory=self._pin)
        for part, src in zip(table_views(staged, n_rows, k), host.arrays, strict=True):
            part.numpy()[:] = src[:, live]
        staged[n_rows * k * ENTRY_BYTES :].view(torch.int64).numpy()[:] = live
        patch = staged.to(self.device, non_blocking=True)
        ids = patch[n_rows * k * ENTRY_BYTES :].view(torch.int64)
        tables = (self._a, self._b, self._r, self._s)
        for dst, part in zip(tables, table_views(patch, n_rows, k), strict=True):
            dst.index_copy_(1, ids, part)
        self.uploads += 1

    @property
    def _pin(self) -> bool:
        return self.device.type == "cuda"

    def _staged(self, buf: torch.Tensor) -> torch.Tensor:
        """`buf` as the source of an asynchronous copy: pinned on CUDA (the caching host allocator
        keeps the pinned block until the copy has completed), the buffer itself elsewhere."""
        return buf.pin_memory() if self._pin else buf

    @property
    def null_slot(self) -> int:
        return self.n_slots - 1

    def group(self, layer: int, group: str) -> GroupTables:
        return _group_views(self._views, (self._a, self._b, self._r, self._s), layer, group)

    def segment_tables(self, seg_slots: torch.Tensor) -> SegmentTables:
        """The tables with one column per segment (its slot's column), gathered on the device
        (inside a CUDA-graph capture the gather is part of the graph, so replays read the live
        mapping and weights): kernels then index them by segment, one dependent load fewer."""
        gathered = tuple(t.index_select(1, seg_slots) for t in (self._a, self._b, self._r, self._s))
        return SegmentTables(gathered)


class SegmentTables:
    """`LoRADeviceTable`'s four tables for one step, one column per segment: [layers x 7, S]."""

    def __init__(self, tables: tuple[torch.Tensor, ...]) -> None:
        self._tables = tables
        self._views: dict[tuple[int, str], GroupTables] = {}

    def group(self, layer: int, group: str) -> GroupTables:
        return _group_views(self._views, self._tables, layer, group)


def _group_views(
    cache: dict[tuple[int, str], GroupTables], tables: tuple[torch.Tensor, ...], layer: int, group: str
) -> GroupTables:
    """Row views of one (layer, group) of four [layers x 7, columns] tables, cached (slicing
    costs microseconds per call)."""
    views = cache.get((layer, group))
    if views is None:
        lo = pair_row(layer, GROUP_SLICES[group][0])
        hi = lo + len(GROUP_SLICES[group])  # a group's slices are adjacent in TARGETS
        a, b, r, s = (t[lo:hi] for t in tables)
        views = GroupTables(a, b, r, s)
        cache[(layer, group)] = views
    return views
