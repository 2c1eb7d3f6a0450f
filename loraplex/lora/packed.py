"""Adapters packed in one buffer: the layout the device pool's extents and the host tier's copies share.

A packed adapter holds its pairs in (layer, target) order, A [r, d_in] then B [d_out, r], every
tensor row-major and starting on a 16-byte boundary (the kernels promise the compiler that
alignment; see `lora/triton_table.py`), padded only to that alignment, never to a larger rank.

`pack_layout` walks an adapter's pairs once (validating their shapes) and returns a
`PackedLayout`: where each tensor goes, the footprint, the facts the engine reads, and per-pair
arrays from which the kernels' pointer tables are filled by a few vectorized operations
(`PackedLayout.arrays`, made on first use). Whatever is placed with the same layout object
reuses all of it, so a load does no Python work per (layer, target) pair. Adapters of the same
shapes and scales share one layout object (`pack_layout` keeps the last 256 by what determines
them).

`packed_weights(flat, start, layout)` is an adapter as views of a buffer. Its pairs (two tensor
views per (layer, target), 448 for an 8B model on all seven targets) are made only when first read
(the torch backend, a copy pair by pair, tests); a load onto the Triton backend never reads them.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from functools import cached_property
from typing import NamedTuple

import numpy as np
import torch

from loraplex.lora.layout import pair_row
from loraplex.lora.weights import AdapterWeights, LoRAPair, WeightFacts, adapted_groups

ALIGN = 16  # bytes: the start of every A and B (see `_ALIGN` in lora/triton_table.py)

PairKey = tuple[int, str]


def round_up(n: int) -> int:
    """`n` bytes rounded up to the alignment."""
    return -(-n // ALIGN) * ALIGN


@dataclass(frozen=True)
class PackedPair:
    key: PairKey
    a_off: int  # bytes from the packed buffer's start
    a_shape: tuple[int, int]
    b_off: int
    b_shape: tuple[int, int]
    scale: float


class PairArrays(NamedTuple):
    """A layout's pairs as arrays, one entry per pair in layout order."""

    row: np.ndarray  # int64: `pair_row(layer, target)`
    a: np.ndarray  # int64: A's offset in elements from the packed buffer's start
    b: np.ndarray  # int64: B's
    rank: np.ndarray  # int32
    scale: np.ndarray  # float32
    d_in: np.ndarray  # int64
    d_out: np.ndarray  # int64


@dataclass(frozen=True, eq=False)
class PackedLayout:
    """Where each tensor of an adapter goes in a packed buffer of `elem`-byte elements."""

    pairs: tuple[PackedPair, ...]
    size: int  # footprint in bytes (alignment gaps included)
    actual: int  # the pairs' own bytes
    elem: int
    facts: WeightFacts

    @cached_property
    def arrays(self) -> PairArrays:
        ps = self.pairs
        return PairArrays(
            np.fromiter((pair_row(*p.key) for p in ps), np.int64, len(ps)),
            np.fromiter((p.a_off // self.elem for p in ps), np.int64, len(ps)),
            np.fromiter((p.b_off // self.elem for p in ps), np.int64, len(ps)),
            np.fromiter((p.a_shape[0] for p in ps), np.int32, len(ps)),
            np.fromiter((p.scale for p in ps), np.float32, len(ps)),
            np.fromiter((p.a_shape[1] for p in ps), np.int64, len(ps)),
            np.fromiter((p.b_shape[0] for p in ps), np.int64, len(ps)),
        )

    @cached_property
    def coverage(self) -> int:
        """OR of `1 << pair_row` over the pairs."""
        mask = 0
        for p in self.pairs:
            mask |= 1 << pair_row(*p.key)
        return mask

    @cached_property
    def ranks_aligned(self) -> bool:
        """Every rank a multiple of 8: the kernels read the pairs where they are (no padded copy)."""
        return all(p.a_shape[0] % 8 == 0 for p in self.pairs)


# Layouts by what determines them (element size; each pair's key, shapes and scale): adapters of
# the same shapes share one layout object, its pairs and arrays, and the kernels' column image
# (lora/triton_table.py); an adapter loaded at runtime then adds no per-pair objects for the
# garbage collector to walk. A few dozen distinct shapes is a large deployment.
_LAYOUTS_KEPT = 256
_layouts: OrderedDict[tuple[object, ...], PackedLayout] = OrderedDict()
_layouts_lock = threading.Lock()


def pack_layout(weights: AdapterWeights, elem: int) -> PackedLayout:
    """The layout of `weights` packed at `elem` bytes per element; validates the shapes first.
    Weights that carry a layout at that element size (`packed_weights`) are not walked again;
    weights of the same shapes and scales as an earlier call's get that call's layout object."""
    known = weights.layout
    if known is not None and known.elem == elem:
        return known
    shapes: list[tuple[PairKey, int, int, int, float]] = []
    for pkey in sorted(weights.pairs):
        pair = weights.pairs[pkey]
        if pair.a.dim() != 2 or pair.b.dim() != 2:
            raise ValueError(
                f"{pkey}: A and B must be 2-D, got {tuple(pair.a.shape)} and {tuple(pair.b.shape)}"
            )
        rank, d_in = (int(n) for n in pair.a.shape)
        if pair.b.shape[1] != rank:
            raise ValueError(f"{pkey}: B {tuple(pair.b.shape)} does not match A's rank {rank}")
        shapes.append((pkey, rank, d_in, int(pair.b.shape[0]), float(pair.scale)))
    key = (elem, *shapes)
    with _layouts_lock:
        lay = _layouts.get(key)
        if lay is not None:
            _layouts.move_to_end(key)
            return lay
    lay = _build_layout(shapes, elem)
    with _layouts_lock:
        lay = _layouts.setdefault(key, lay)  # (another thread's, if it built the same one first)
        while len(_layouts) > _LAYOUTS_KEPT:
            _layouts.popitem(last=False)
    return lay


def _build_layout(shapes: list[tuple[PairKey, int, int, int, float]], elem: int) -> PackedLayout:
    pairs: list[PackedPair] = []
    off = actual = 0
    for pkey, rank, d_in, d_out, scale in shapes:
        a_bytes, b_bytes = rank * d_in * elem, d_out * rank * elem
        b_off = off + round_up(a_bytes)
        pairs.append(PackedPair(pkey, off, (rank, d_in), b_off, (d_out, rank), scale))
        off = b_off + round_up(b_bytes)
        actual += a_bytes + b_bytes
    ranks = {p.key: p.a_shape[0] for p in pairs}
    facts = WeightFacts(ranks, max(ranks.values(), default=0), actual, adapted_groups(ranks))
    return PackedLayout(tuple(pairs), off, actual, elem, facts)


class PackedViews(Mapping[PairKey, LoRAPair]):
    """The pairs of a packed buffer as tensor views, made on first read (all at once)."""

    __slots__ = ("_flat", "_start", "_layout", "_pairs")

    def __init__(self, flat: torch.Tensor, start: int, layout: PackedLayout) -> None:
        self._flat, self._start, self._layout = flat, start, layout
        self._pairs: dict[PairKey, LoRAPair] | None = None

    @property
    def built(self) -> bool:
        """Whether the views exist yet (tests check that a load does not make them)."""
        return self._pairs is not None

    def forget(self) -> None:
        """Drop the views made so far; the next read makes them again. (A cached adapter's views
        are ~3 tracked objects a pair that every full garbage-collection pass walks.)"""
        self._pairs = None

    def _built(self) -> dict[PairKey, LoRAPair]:
        if self._pairs is None:
            flat, start, elem = self._flat, self._start, self._layout.elem
            view = flat.as_strided  # one call per tensor (a slice then a view would be two)
            out = {}
            for p in self._layout.pairs:
                a = view(p.a_shape, (p.a_shape[1], 1), (start + p.a_off) // elem)
                b = view(p.b_shape, (p.b_shape[1], 1), (start + p.b_off) // elem)
                out[p.key] = LoRAPair(a, b, p.scale)
            self._pairs = out
        return self._pairs

    def __getitem__(self, key: PairKey) -> LoRAPair:
        return self._built()[key]

    def get(self, key: PairKey, default: LoRAPair | None = None) -> LoRAPair | None:  # type: ignore[override]
        return self._built().get(key, default)

    def __iter__(self) -> Iterator[PairKey]:
        return iter(self._built())

    def __len__(self) -> int:
        return len(self._layout.pairs)


def packed_weights(flat: torch.Tensor, start: int, layout: PackedLayout) -> AdapterWeights:
    """The adapter laid out as `layout` from `start` bytes into the 1-D tensor `flat`: its extent
    as one span (`packed`), its facts from the layout, its pairs as views made on first read."""
    elem = flat.element_size()
    assert elem == layout.elem and start % ALIGN == 0, (elem, layout.elem, start)
    span = flat[start // elem : (start + layout.size) // elem]
    return AdapterWeights.with_facts(PackedViews(flat, start, layout), layout.facts, span, layout)
