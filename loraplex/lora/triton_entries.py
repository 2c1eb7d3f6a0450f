"""The host side of the Triton backend's tables (`lora/triton_table.py`): what each slot's adapter
puts in them, and which (layer, target)s the slots adapt at which shapes.

A slot's *entries* hold one (row, A offset, B offset, rank, scale) per pair. The device writes a
slot's column from a *column image*: per table row, A and B offsets relative to the slot's
`offset`, whether a pair is there, its rank and scale (`column_image`), so that
A = image A + offset x present, and likewise B. For weights packed with a layout (the device
pool's extents, `lora/packed.py`) the image is the layout's, made and uploaded once per layout,
and `offset` is the extent's place relative to the tables' base: a load writes its column with a
few device operations and a scalar, no host -> device copy and no Python work per (layer, target).
Other weights (tests, warm-up, odd ranks, which need a padded copy) get an image of their own with
absolute offsets (`offset` 0), walked pair by pair.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from loraplex.lora.layout import TARGETS, pair_row
from loraplex.lora.packed import PackedLayout
from loraplex.lora.weights import AdapterWeights

ALIGN = 16  # bytes; the kernels promise the compiler 16-byte aligned weight rows
# the four tables, in buffer order: A and B element offsets, rank, scale
TABLE_DTYPES = (torch.int64, torch.int64, torch.int32, torch.float32)
_SIZES = (8, 8, 4, 4)
ENTRY_BYTES = sum(_SIZES)
# a column image: A, B, present (int64), rank (int32), scale (float32) per row
_IMAGE_DTYPES = (torch.int64, torch.int64, torch.int64, torch.int32, torch.float32)
_IMAGE_SIZES = (8, 8, 8, 4, 4)
IMAGE_BYTES = sum(_IMAGE_SIZES)

PaddedPairs = dict[tuple[int, int, int], tuple[torch.Tensor, torch.Tensor, int]]


def kernel_ready(t: torch.Tensor) -> torch.Tensor:
    """Row-major and 16-byte aligned, copying only when the caller's tensor is not."""
    if t.is_contiguous() and t.data_ptr() % ALIGN == 0:
        return t
    return t.contiguous().clone()


def padded_pair(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(A, B, rank) as the kernels read them: the rank a multiple of 8, so that B's rows start
    16-byte aligned for every adapter and the kernels need no variant for unaligned ranks. Other
    ranks are padded with zero rows of A and zero columns of B (a copy, on the weights' device):
    the padded columns of H are exact zeros, and so are their products with B, so the result is
    the same as at the adapter's own rank (the kernels' rank tile already padded with zeros)."""
    rank = int(a.shape[0])
    if rank % 8 == 0:
        return kernel_ready(a), kernel_ready(b), rank
    padded = rank + (-rank) % 8
    pa = a.new_zeros((padded, a.shape[1]))
    pa[:rank] = a
    pb = b.new_zeros((b.shape[0], padded))
    pb[:, :rank] = b
    return pa, pb, padded


@dataclass(frozen=True)
class SlotEntries:
    """What one slot's adapter puts in the tables."""

    row: np.ndarray  # int64 per pair: pair_row(layer, target)
    d_in: np.ndarray  # int64 per pair
    d_out: np.ndarray
    coverage: int  # OR of 1 << row
    max_rank: int
    offset: int  # element offset the image's A and B offsets are relative to
    keep: tuple[torch.Tensor, ...]  # every tensor whose address the entries hold
    layout: PackedLayout | None = None  # the column image is the layout's (shared), else:
    columns: tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray] | None = None  # per pair:
    # absolute A and B offsets, rank, scale
    padded: PaddedPairs = field(default_factory=dict)  # padded copies of odd-rank pairs, for reuse


def weight_dtypes(weights: AdapterWeights) -> set[torch.dtype]:
    if weights.packed is not None and weights.layout is not None:
        return {weights.packed.dtype}
    return {t.dtype for p in weights.pairs.values() for t in (p.a, p.b)}


def packed_entries(weights: AdapterWeights, base: torch.Tensor) -> SlotEntries | None:
    """The entries of weights packed with a layout, read where they are (ranks multiples of 8,
    16-byte aligned, on `base`'s device in its dtype); None for any other weights."""
    lay, span = weights.layout, weights.packed
    if lay is None or span is None or not lay.ranks_aligned:
        return None
    if span.device != base.device or span.dtype != base.dtype or span.data_ptr() % ALIGN:
        return None
    # the layout puts every tensor on an aligned offset from the span's aligned start
    offset = (span.data_ptr() - base.data_ptr()) // base.element_size()
    arr = lay.arrays
    return SlotEntries(arr.row, arr.d_in, arr.d_out, lay.coverage, lay.facts.max_rank, offset, (span,), lay)


def pair_entries(slot: int, weights: AdapterWeights, base: torch.Tensor, reuse: PaddedPairs) -> SlotEntries:
    """The entries of any weights, pair by pair (`reuse`: padded copies made before)."""
    elem, base_ptr = base.element_size(), base.data_ptr()
    cols: list[list[int]] = [[] for _ in range(6)]  # row, a, b, rank, d_in, d_out
    scales: list[float] = []
    keep: list[torch.Tensor] = []
    padded: PaddedPairs = {}
    mask = max_rank = 0
    for (layer, target), pair in weights.pairs.items():
        if pair.a.device != base.device or pair.b.device != base.device:
            raise ValueError(f"slot {slot} ({layer}, {target}): weights not on {base.device}")
        rank, d_in = (int(n) for n in pair.a.shape)
        d_out = int(pair.b.shape[0])
        if tuple(pair.b.shape) != (d_out, rank):
            raise ValueError(f"slot {slot} ({layer}, {target}): B {tuple(pair.b.shape)}, rank {rank}")
        key = (pair.a.data_ptr(), pair.b.data_ptr(), rank)
        pa, pb, rank = padded[key] = reuse.get(key) or padded_pair(pair.a, pair.b)
        keep += [pa, pb, pair.a, pair.b]
        row = pair_row(layer, target)
        a_off, b_off = (pa.data_ptr() - base_ptr) // elem, (pb.data_ptr() - base_ptr) // elem
        for col, v in zip(cols, (row, a_off, b_off, rank, d_in, d_out), strict=True):
            col.append(v)
        scales.append(pair.scale)
        mask |= 1 << row
        max_rank = max(max_rank, rank)
    row_, a, b, r, d_in_, d_out_ = (np.array(c, np.int64) for c in cols)
    columns = (a, b, r.astype(np.int32), np.array(scales, np.float32))
    return SlotEntries(row_, d_in_, d_out_, mask, max_rank, 0, tuple(keep), None, columns, padded)


def column_image(
    n_rows: int,
    row: np.ndarray,
    a: np.ndarray,
    b: np.ndarray,
    rank: np.ndarray,
    scale: np.ndarray,
    present: bool,
) -> torch.Tensor:
    """A slot's column as a host byte buffer (`image_views`); `present`: whether A and B take the
    slot's offset (relative offsets) or not (absolute ones)."""
    image = torch.zeros(n_rows * IMAGE_BYTES, dtype=torch.uint8)
    parts = (a, b, 1 if present else 0, rank, scale)
    for part, values in zip(image_views(image, n_rows), parts, strict=True):
        part.numpy()[row] = values
    return image


def image_views(image: torch.Tensor, n_rows: int) -> tuple[torch.Tensor, ...]:
    """A column image's five [n_rows] parts: A, B, present, rank, scale."""
    return _views(image, (n_rows,), _IMAGE_DTYPES, _IMAGE_SIZES)


def table_views(buf: torch.Tensor, n_rows: int, n_slots: int) -> tuple[torch.Tensor, ...]:
    """The four tables as [n_rows, n_slots] views of the byte buffer `buf`."""
    return _views(buf, (n_rows, n_slots), TABLE_DTYPES, _SIZES)


def _views(
    buf: torch.Tensor, shape: tuple[int, ...], dtypes: tuple[torch.dtype, ...], sizes: tuple[int, ...]
) -> tuple[torch.Tensor, ...]:
    out, pos, n = [], 0, shape[0] * (shape[1] if len(shape) > 1 else 1)
    for dtype, size in zip(dtypes, sizes, strict=True):
        out.append(buf[pos : pos + n * size].view(dtype).view(shape))
        pos += n * size
    return tuple(out)


class SlotBook:
    """Which slot holds which entries, and each (layer, target)'s shape, counted over the slots
    that adapt it (the kernels trust it; `ops_triton._check`)."""

    def __init__(self, n_rows: int) -> None:
        self.n_rows = n_rows
        self.refs = np.zeros(n_rows, np.int32)  # slots adapting each (layer, target)
        self.d_in = np.zeros(n_rows, np.int64)
        self.d_out = np.zeros(n_rows, np.int64)
        self.entries: dict[int, SlotEntries] = {}
        self.coverage: dict[int, int] = {}  # slot -> OR of target bits over its pairs
        self.max_rank: dict[int, int] = {}
        self.dims_version = 0  # bumped when the set of adapted (layer, target)s changes

    def put(self, slot: int, e: SlotEntries) -> None:
        """Record slot `slot`'s entries (it holds none now); ValueError, changing nothing, when a
        pair's shape differs from another adapter's of the same (layer, target)."""
        if e.row.size and int(e.row.max()) >= self.n_rows:
            raise ValueError(f"slot {slot}: a layer past the table's {self.n_rows // len(TARGETS)}")
        known = self.refs[e.row] > 0
        bad = known & ((self.d_in[e.row] != e.d_in) | (self.d_out[e.row] != e.d_out))
        if bad.any():
            layer, t = divmod(int(e.row[np.flatnonzero(bad)[0]]), len(TARGETS))
            raise ValueError(f"slot {slot} ({layer}, {TARGETS[t]}): shape differs from other adapters")
        if not known.all():
            self.dims_version += 1
        self.refs[e.row] += 1
        self.d_in[e.row], self.d_out[e.row] = e.d_in, e.d_out
        self.entries[slot] = e
        self.coverage[slot], self.max_rank[slot] = e.coverage, e.max_rank

    def take(self, slot: int) -> SlotEntries | None:
        """Forget slot `slot`'s entries (returned)."""
        e = self.entries.pop(slot, None)
        if e is not None:
            self.refs[e.row] -= 1
            if not self.refs[e.row].all():
                self.dims_version += 1
            del self.coverage[slot], self.max_rank[slot]
        return e

    def padded(self) -> PaddedPairs:
        """Every slot's padded copies, for new entries to reuse."""
        return {k: v for e in self.entries.values() for k, v in e.padded.items()}

    def dims(self) -> dict[tuple[int, str], tuple[int, int]]:
        """(layer, target) -> (d_in, d_out), over the adapted ones."""
        rows = np.flatnonzero(self.refs > 0)
        keys = (divmod(int(row), len(TARGETS)) for row in rows)
        shapes = zip(self.d_in[rows].tolist(), self.d_out[rows].tolist(), strict=True)
        return {(layer, TARGETS[t]): shape for (layer, t), shape in zip(keys, shapes, strict=True)}
