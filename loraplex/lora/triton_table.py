"""Device-side copy of the slot table: per (layer, target), slot -> (A, B, rank, scale).

A and B are element offsets from one base buffer (`LoRADeviceTable.base`), so a kernel turns
them into pointers that the compiler knows are 16-byte aligned. The kernels read weights
through these tables, so every adapter stays at its own rank: nothing
is padded, and adapters of different ranks share one launch. The tables are rebuilt only when
`LoRASlotTable.version` changes (an adapter loaded into or cleared from a slot), never per step.

CUDA graphs record these tables' addresses, so a rebuild writes into the same device tensors
whenever they are large enough (the capacity grows in powers of two); `epoch` counts the times
they had to be reallocated, which invalidates captured graphs. Every rank in the tables is a
multiple of 8 (`_padded_pair`), so no adapter's rank changes what the kernels compile. The last
slot column is the *null slot* (rank 0 everywhere): the empty segments of a captured step point
at it, so they read no weights.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from loraplex.lora.layout import GROUP_SLICES, TARGETS
from loraplex.lora.weights import LoRASlotTable

_TARGET_INDEX = {t: i for i, t in enumerate(TARGETS)}
_ALIGN = 16  # bytes; the kernels promise the compiler 16-byte aligned weight rows


def target_bit(layer: int, target: str) -> int:
    """Bit of (layer, target) in a slot's coverage mask."""
    return 1 << (layer * len(TARGETS) + _TARGET_INDEX[target])


@dataclass(frozen=True)
class GroupTables:
    """Views of one (layer, group): [n_slices, n_slots] each, slices in GROUP_SLICES order."""

    a_offs: torch.Tensor  # int64 element offsets from LoRADeviceTable.base
    b_offs: torch.Tensor  # int64
    ranks: torch.Tensor  # int32
    scales: torch.Tensor  # float32


def _kernel_ready(t: torch.Tensor) -> torch.Tensor:
    """Row-major and 16-byte aligned, copying only when the caller's tensor is not."""
    if t.is_contiguous() and t.data_ptr() % _ALIGN == 0:
        return t
    return t.contiguous().clone()


def _padded_pair(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(A, B, rank) as the kernels read them: the rank a multiple of 8, so that B's rows start
    16-byte aligned for every adapter and the kernels need no variant for unaligned ranks. Other
    ranks are padded with zero rows of A and zero columns of B (a copy, on the weights' device):
    the padded columns of H are exact zeros, and so are their products with B, so the result is
    the same as at the adapter's own rank (the kernels' rank tile already padded with zeros)."""
    rank = int(a.shape[0])
    if rank % 8 == 0:
        return _kernel_ready(a), _kernel_ready(b), rank
    padded = rank + (-rank) % 8
    pa = a.new_zeros((padded, a.shape[1]))
    pa[:rank] = a
    pb = b.new_zeros((b.shape[0], padded))
    pb[:, :rank] = b
    return pa, pb, padded


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
        self.slot_coverage: dict[int, int] = {}  # slot -> OR of target_bit over its pairs
        self.slot_max_rank: dict[int, int] = {}
        self.dims: dict[tuple[int, str], tuple[int, int]] = {}  # (layer, target) -> (d_in, d_out)
        self._keep: list[torch.Tensor] = []  # holds every tensor whose address is in the tables
        self._padded: dict[tuple[int, int, int], tuple[torch.Tensor, torch.Tensor, int]] = {}
        self._a = self._b = self._r = self._s = torch.empty(0)
        self._views: dict[tuple[int, str], GroupTables] = {}  # slicing costs microseconds per call

    def sync(self, table: LoRASlotTable) -> None:
        """Rebuild when the slot table changed since the last call; otherwise free."""
        if table is self._source and table.version == self.version:
            return
        self._build(table)
        self._source = table
        self.version = table.version

    def _build(self, table: LoRASlotTable) -> None:
        items = table.items()
        n_rows = table.num_layers * len(TARGETS)
        needed = max(max((slot for slot, _ in items), default=-1) + 2, table.capacity + 1)  # + the null slot
        dtypes = {t.dtype for _, w in items for p in w.pairs.values() for t in (p.a, p.b)}
        if len(dtypes) > 1:
            raise ValueError(f"LoRA weights mix dtypes {sorted(map(str, dtypes))}; the kernels need one")
        dtype = dtypes.pop() if dtypes else (self.dtype or table.dtype or torch.float32)
        realloc = needed > self.n_slots or self._a.shape[0] != n_rows or self.base.dtype != dtype
        if realloc:
            n_slots = max(16, 1 << (needed - 1).bit_length())
            # Absent entries (offset 0, rank 0) point at the base itself, a real buffer: no load is
            # ever issued for them (rank 0 masks everything), but no pointer is ever null either.
            base = torch.zeros(64, dtype=dtype, device=self.device)
        else:
            n_slots, base = self.n_slots, self.base
        elem = base.element_size()
        a = torch.zeros((n_rows, n_slots), dtype=torch.int64)
        b = a.clone()
        r = torch.zeros(a.shape, dtype=torch.int32)
        s = torch.zeros(a.shape, dtype=torch.float32)
        keep = [base]
        padded: dict[tuple[int, int, int], tuple[torch.Tensor, torch.Tensor, int]] = {}
        coverage: dict[int, int] = {}
        max_rank: dict[int, int] = {}
        dims: dict[tuple[int, str], tuple[int, int]] = {}
        for slot, weights in items:
            mask = 0
            for (layer, target), pair in weights.pairs.items():
                if pair.a.device != self.device or pair.b.device != self.device:
                    raise ValueError(f"slot {slot} ({layer}, {target}): weights not on {self.device}")
                rank, d_in = pair.a.shape
                d_out = int(pair.b.shape[0])
                if tuple(pair.b.shape) != (d_out, rank):
                    raise ValueError(f"slot {slot} ({layer}, {target}): B {tuple(pair.b.shape)}, rank {rank}")
                if dims.setdefault((layer, target), (d_in, d_out)) != (d_in, d_out):
                    raise ValueError(f"slot {slot} ({layer}, {target}): shape differs from other adapters")
                key = (pair.a.data_ptr(), pair.b.data_ptr(), rank)
                pa, pb, rank = padded[key] = self._padded.get(key) or _padded_pair(pair.a, pair.b)
                keep += [pa, pb, pair.a, pair.b]
                row = layer * len(TARGETS) + _TARGET_INDEX[target]
                a[row, slot] = (pa.data_ptr() - base.data_ptr()) // elem
                b[row, slot] = (pb.data_ptr() - base.data_ptr()) // elem
                r[row, slot], s[row, slot] = rank, pair.scale
                mask |= target_bit(layer, target)
                max_rank[slot] = max(max_rank.get(slot, 0), rank)
            coverage[slot] = mask
        if realloc:
            self.epoch += 1
        self.dtype, self.base = (dtype if items or table.dtype is not None else self.dtype), base
        if realloc:
            self.n_slots = n_slots
            self._a, self._b = a.to(self.device), b.to(self.device)
            self._r, self._s = r.to(self.device), s.to(self.device)
            self._views = {}
        else:  # in place: captured graphs keep reading these tensors
            for dst, src in ((self._a, a), (self._b, b), (self._r, r), (self._s, s)):
                dst.copy_(src)
        self._keep = keep
        self._padded = padded  # the padded copies of odd-rank pairs, reused by the next rebuild
        self.slot_coverage, self.slot_max_rank, self.dims = coverage, max_rank, dims

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
        lo = layer * len(TARGETS) + _TARGET_INDEX[GROUP_SLICES[group][0]]
        hi = lo + len(GROUP_SLICES[group])  # a group's slices are adjacent in TARGETS
        a, b, r, s = (t[lo:hi] for t in tables)
        views = GroupTables(a, b, r, s)
        cache[(layer, group)] = views
    return views
