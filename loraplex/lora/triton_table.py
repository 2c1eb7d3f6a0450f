"""Device-side copy of the slot table: per (layer, target), slot -> (A, B, rank, scale).

A and B are element offsets from one base buffer (`LoRADeviceTable.base`), so a kernel turns
them into pointers that the compiler knows are 16-byte aligned. The kernels read weights
through these tables, so every adapter stays at its own rank: nothing
is padded, and adapters of different ranks share one launch. The tables change only when
`LoRASlotTable.version` does (an adapter loaded into or cleared from a slot), never per step.

An update touches only the slots that changed since the last one (`LoRASlotTable.changed_since`).
A slot's column is written on the device, on the current stream, from a column image
(`lora/triton_entries.py`): for an adapter in the device pool, its layout's image (uploaded once
per layout) plus the extent's offset as a scalar, i.e. a few small kernels and no host -> device
copy, whatever the number of (layer, target) pairs; a cleared slot's column is zeroed. Every step
queued after an update reads the new columns and every step queued before it the old ones. A
first sync, another slot table, a slot past the capacity or another dtype rebuild every column.

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
from loraplex.lora.packed import PackedLayout
from loraplex.lora.triton_entries import (
    ENTRY_BYTES,
    SlotBook,
    SlotEntries,
    column_image,
    image_views,
    packed_entries,
    pair_entries,
    table_views,
    weight_dtypes,
)
from loraplex.lora.weights import LoRASlotTable

_IMAGES_KEPT = 1024  # layouts whose column image a device table keeps


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
        self._book = SlotBook(0)
        self._buf = torch.empty(0, dtype=torch.uint8)  # the four tables, one device buffer
        self._a = self._b = self._r = self._s = torch.empty(0)
        self._views: dict[tuple[int, str], GroupTables] = {}  # slicing costs microseconds per call
        self._dims: tuple[int, dict[tuple[int, str], tuple[int, int]]] = (-1, {})
        # id(layout) -> (layout, its column image on the device)
        self._images: dict[int, tuple[PackedLayout, tuple[torch.Tensor, ...]]] = {}
        self.uploads = 0  # host -> device copies of column images (tests count them)

    @property
    def slot_coverage(self) -> dict[int, int]:
        """slot -> OR of target_bit over its pairs."""
        return self._book.coverage

    @property
    def slot_max_rank(self) -> dict[int, int]:
        return self._book.max_rank

    @property
    def dims(self) -> dict[tuple[int, str], tuple[int, int]]:
        """(layer, target) -> (d_in, d_out) of the adapted ones (made again only when that set
        changes)."""
        if self._dims[0] != self._book.dims_version:
            self._dims = (self._book.dims_version, self._book.dims())
        return self._dims[1]

    def sync(self, table: LoRASlotTable) -> None:
        """Bring the tables up to `table` (only the changed slots' columns when it is the table
        synced last); free when nothing changed. On an error the tables are as they were and the
        next call rebuilds them."""
        if table is self._source and table.version == self.version:
            return
        if self.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            # the column writes would be recorded into the graph and replayed with stale values
            raise RuntimeError("LoRA slot table changed during a CUDA-graph capture: sync before capturing")
        changed = table.changed_since(self.version) if table is self._source else None
        self._source = None  # until done: an error leaves the next call a whole rebuild
        if changed is None or not self._update(table, changed):
            self._rebuild(table)
        self._source = table
        self.version = table.version

    def _entries(self, slot: int, table: LoRASlotTable, book: SlotBook, base: torch.Tensor) -> SlotEntries:
        weights = table.weights(slot)
        return packed_entries(weights, base) or pair_entries(slot, weights, base, book.padded())

    def _update(self, table: LoRASlotTable, changed: list[int]) -> bool:
        """Rewrite the columns of the `changed` slots in place; False (nothing done) when the
        tables must be rebuilt instead."""
        slots = sorted(set(changed))
        book = self._book
        for slot in slots:
            if slot in table:
                dtypes = weight_dtypes(table.weights(slot))
                if slot + 2 > self.n_slots or (dtypes and dtypes != {self.base.dtype}):
                    return False
        new = {slot: self._entries(slot, table, book, self.base) for slot in slots if slot in table}
        old = {slot: e for slot in slots if (e := book.take(slot)) is not None}
        try:
            for slot, entries in new.items():
                book.put(slot, entries)
        except ValueError:
            for slot in slots:  # the book as it was; the device tables were not touched
                book.take(slot)
            for slot, entries in old.items():
                book.put(slot, entries)
            raise
        for slot in slots:
            if slot in new:
                self._write(slot, new[slot])  # the whole column: no need to clear it first
            elif slot in old:
                for t in (self._a, self._b, self._r, self._s):
                    t[:, slot].zero_()
        return True

    def _rebuild(self, table: LoRASlotTable) -> None:
        items = table.items()
        n_rows = table.num_layers * len(TARGETS)
        needed = max(max((slot for slot, _ in items), default=-1) + 2, table.capacity + 1)  # + the null slot
        dtypes = set().union(*(weight_dtypes(w) for _, w in items))
        if len(dtypes) > 1:
            raise ValueError(f"LoRA weights mix dtypes {sorted(map(str, dtypes))}; the kernels need one")
        dtype = dtypes.pop() if dtypes else (self.dtype or table.dtype or torch.float32)
        realloc = needed > self.n_slots or self._book.n_rows != n_rows or self.base.dtype != dtype
        if realloc:
            n_slots = max(16, 1 << (needed - 1).bit_length())
            # Absent entries (offset 0, rank 0) point at the base itself, a real buffer: no load is
            # ever issued for them (rank 0 masks everything), but no pointer is ever null either.
            base = torch.zeros(64, dtype=dtype, device=self.device)
        else:
            n_slots, base = self.n_slots, self.base
        book = SlotBook(n_rows)
        for slot, _ in items:  # everything checked before the device tables change
            book.put(slot, self._entries(slot, table, self._book, base))
        if realloc:
            self.epoch += 1
            self.n_slots = n_slots
            self._buf = torch.zeros(n_rows * n_slots * ENTRY_BYTES, dtype=torch.uint8, device=self.device)
            self._a, self._b, self._r, self._s = table_views(self._buf, n_rows, n_slots)
            self._views = {}
        else:  # in place: captured graphs keep reading these tensors
            self._buf.zero_()
        if self._book.n_rows != n_rows:
            self._images = {}
        self.dtype, self.base = (dtype if items or table.dtype is not None else self.dtype), base
        self._book = book
        self._dims = (-1, {})
        for slot, entries in book.entries.items():
            self._write(slot, entries)

    def _write(self, slot: int, e: SlotEntries) -> None:
        """Write slot `slot`'s whole column on the device: A and B are the image's offsets plus
        the slot's offset where a pair is, rank and scale the image's."""
        a, b, present, rank, scale = self._image(e)
        torch.add(a, present, alpha=e.offset, out=self._a[:, slot])
        torch.add(b, present, alpha=e.offset, out=self._b[:, slot])
        self._r[:, slot].copy_(rank)
        self._s[:, slot].copy_(scale)

    def _image(self, e: SlotEntries) -> tuple[torch.Tensor, ...]:
        """`e`'s column image on the device, as its five parts: its layout's, kept (uploaded once
        per layout), or one of its own."""
        n_rows, lay = self._book.n_rows, e.layout
        if lay is None:
            assert e.columns is not None
            a, b, rank, scale = e.columns
            return self._upload(column_image(n_rows, e.row, a, b, rank, scale, present=False))
        hit = self._images.get(id(lay))
        if hit is not None and hit[0] is lay:
            return hit[1]
        arr = lay.arrays
        image = self._upload(column_image(n_rows, arr.row, arr.a, arr.b, arr.rank, arr.scale, present=True))
        if len(self._images) >= _IMAGES_KEPT:
            del self._images[next(iter(self._images))]
        self._images[id(lay)] = (lay, image)
        return image

    def _upload(self, image: torch.Tensor) -> tuple[torch.Tensor, ...]:
        self.uploads += 1
        if self.device.type != "cuda":
            on_device = image.to(self.device)
        else:  # pinned, so the copy is asynchronous (the caching host allocator keeps the pinned
            # block until the copy has completed)
            on_device = image.pin_memory().to(self.device, non_blocking=True)
        return image_views(on_device, self._book.n_rows)

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
