"""The device adapter pool: one preallocated region, each adapter stored at its exact ranks.

`AdapterPool(budget_bytes, dtype, device)` allocates one flat tensor up front (host memory on the
CPU) and never allocates on the serving path. Each placed adapter gets one contiguous *extent*
holding its pairs packed as `lora/packed.py` lays them out: (layer, target) order, A [r, d_in]
then B [d_out, r], every tensor row-major and starting on a 16-byte boundary (the kernels promise
the compiler that alignment; see `lora/triton_table.py`). Padding is only that alignment (at
most 15 bytes per tensor), never a rank padded to a global maximum, so allocated / actual bytes
stays within a few per mille for real shapes. The kernels address every A and B by an element
offset from one base buffer, so the pool needs no kernel change: the device table's offsets
simply point into it. An extent's weights (`weights(key)`) carry it as one span with its
layout: the device tables are filled from the span's address and the layout's offsets, and the
per-pair tensor views are made only when something reads them (lora/packed.py). The host tier
packs its copies with the same layout, so a placement or a load is one contiguous copy.

Fragmentation: compaction, not paging. A pair must stay contiguous (one pointer), so a page would
have to be as large as the largest A or B of any adapter (r = 64 on a 14336-wide down projection:
1.8 MiB) while a rank-4 k projection's B is 8 KiB: pages that large break the 1.05 bound, and
smaller pages would need a pointer per page, i.e. a kernel change. Instead a placement takes the
best-fitting free run; when no run is large enough but the free bytes are, the pool slides the
live extents of the *cheapest window* (the address range with enough free bytes inside and the
fewest live bytes to move) down over its holes, leaving one free run. So an adapter is always
placed when the free bytes are at least its footprint (and no unmovable extent splits the room),
and a compaction moves as few bytes as the layout allows rather than the whole pool.

Moving a live adapter makes the views handed out for it stale. `place` therefore returns the keys
it moved with their new weights (the caller re-points its slot table, whose version bump makes
the device tables refresh), and every key carries a generation bumped on each move. Keys in
`fixed` (e.g. the slots the running step has pinned, whose data a kernel may be reading) are
never moved; on CUDA the caller also orders the copies after any in-flight step that reads the
moved extents (same stream, or an event).

Asynchronous loads (`adapters/h2d_copy.py`): `place(..., copy=False)` only reserves the extent,
whose bytes a side-stream copy then writes; such keys are *in flight* until `settle`, and a
compaction never moves them either (it copies on the step's stream, which would race the
side-stream copy and could move bytes not yet written).
"""

from __future__ import annotations

from collections.abc import Collection, Iterator
from dataclasses import dataclass, field

import torch

from loraplex.lora.packed import ALIGN, PackedLayout, pack_layout, packed_weights
from loraplex.lora.weights import AdapterWeights

__all__ = ["ALIGN", "AdapterPool", "Placement", "PoolFullError"]


class PoolFullError(RuntimeError):
    """No room for an adapter in the pool (the message says how many bytes, and why)."""


_LAYOUT_MEMO = 256  # adapters whose layout a pool remembers


@dataclass
class _Extent:
    start: int  # bytes from the pool's start, a multiple of ALIGN
    layout: PackedLayout  # the pairs' places inside the extent, its footprint, the facts
    generation: int = 0
    # the weights at `start`, made once (reserve and commit both ask for them; their views are
    # made only when read, see lora/packed.py)
    cached: tuple[int, AdapterWeights] | None = None

    @property
    def size(self) -> int:  # footprint: aligned bytes
        return self.layout.size

    @property
    def actual(self) -> int:  # the pairs' own bytes
        return self.layout.actual


@dataclass(frozen=True)
class Placement:
    """What `place` did: the new adapter's weights (views into the pool), and the weights of every
    adapter a compaction moved to make room (their earlier views now read other data)."""

    weights: AdapterWeights
    moved: dict[str, AdapterWeights] = field(default_factory=dict)


class AdapterPool:
    def __init__(self, budget_bytes: int, dtype: torch.dtype, device: torch.device | str) -> None:
        if budget_bytes < ALIGN:
            raise ValueError(f"adapter pool budget {budget_bytes} bytes is below one {ALIGN}-byte unit")
        if not dtype.is_floating_point:
            raise ValueError(f"adapter pool dtype must be a floating type, got {dtype}")
        self.dtype = dtype
        # id(weights) -> (weights, its layout), for weights that carry none
        self._layouts: dict[int, tuple[AdapterWeights, PackedLayout]] = {}
        self.elem = torch.empty(0, dtype=dtype).element_size()
        self.budget_bytes = budget_bytes // ALIGN * ALIGN
        self.buffer = torch.empty(self.budget_bytes // self.elem, dtype=dtype, device=device)
        if self.buffer.data_ptr() % ALIGN:
            raise RuntimeError(
                f"adapter pool buffer at {self.buffer.data_ptr():#x} is not {ALIGN}-byte aligned"
            )
        self._extents: dict[str, _Extent] = {}
        self.allocated_bytes = 0
        self.used_bytes = 0
        self.compactions = 0  # placements that had to move live adapters
        self.bytes_moved = 0
        self.in_flight: set[str] = set()  # reserved keys an asynchronous copy is still writing

    # --- sizes ----------------------------------------------------------------------------------

    def footprint(self, weights: AdapterWeights) -> int:
        """Bytes `weights` takes in this pool (its pairs at the pool's dtype, each tensor aligned)."""
        return self._layout(weights).size

    @property
    def free_bytes(self) -> int:
        return self.budget_bytes - self.allocated_bytes

    @property
    def largest_free_extent(self) -> int:
        return max((size for _, size in self._holes()), default=0)

    def stats(self) -> dict[str, int]:
        """The pool's numbers, for metrics: counts and bytes."""
        return {
            "adapters": len(self._extents),
            "budget_bytes": self.budget_bytes,
            "allocated_bytes": self.allocated_bytes,
            "used_bytes": self.used_bytes,
            "free_bytes": self.free_bytes,
            "largest_free_extent": self.largest_free_extent,
            "compactions": self.compactions,
            "bytes_moved": self.bytes_moved,
        }

    def fits(self, nbytes: int) -> bool:
        """Whether an adapter of footprint `nbytes` can be placed now (moving others if need be,
        none of them fixed)."""
        return nbytes <= self.free_bytes

    # --- keys -----------------------------------------------------------------------------------

    def __contains__(self, key: str) -> bool:
        return key in self._extents

    def __len__(self) -> int:
        return len(self._extents)

    def keys(self) -> Iterator[str]:
        return iter(self._extents)

    def generation(self, key: str) -> int:
        """Bumped each time `key`'s extent moves: views taken at another generation are stale."""
        return self._extents[key].generation

    def allocated_of(self, key: str) -> int:
        return self._extents[key].size

    def actual_of(self, key: str) -> int:
        return self._extents[key].actual

    def span(self, key: str) -> torch.Tensor:
        """`key`'s extent as one 1-D view of the pool (alignment gaps included)."""
        ext = self._extents[key]
        return self.buffer[ext.start // self.elem : (ext.start + ext.size) // self.elem]

    def weights(self, key: str) -> AdapterWeights:
        """`key`'s weights as views into the pool at its current place."""
        ext = self._extents[key]
        if ext.cached is None or ext.cached[0] != ext.start:
            ext.cached = (ext.start, packed_weights(self.buffer, ext.start, ext.layout))
        return ext.cached[1]

    # --- placing and freeing --------------------------------------------------------------------

    def place(
        self,
        key: str,
        weights: AdapterWeights,
        *,
        fixed: Collection[str] = (),
        non_blocking: bool = False,
        copy: bool = True,
    ) -> Placement:
        """Copy `weights` into the pool under `key` and return views of them, compacting when no
        free run is large enough. Adapters in `fixed` and in flight are not moved. `copy=False`
        only reserves the extent and marks `key` in flight (its caller copies, then `settle`s);
        it returns the extent as a span (`packed`, no pairs: `weights(key)` is the adapter).
        Raises `PoolFullError` (and changes nothing) when the room cannot be made, ValueError on
        malformed weights."""
        if key in self._extents:
            raise ValueError(f"adapter {key[:12]} is already in the pool")
        lay = self._layout(weights)
        size = lay.size
        start = self._best_fit(size)
        moved: dict[str, AdapterWeights] = {}
        if start is None:
            start, moved = self._compact_for(size, key, frozenset(fixed) | self.in_flight)
        self._extents[key] = _Extent(start, lay)
        self.allocated_bytes += size
        self.used_bytes += lay.actual
        if not copy:
            self.in_flight.add(key)
            return Placement(AdapterWeights({}, self.span(key)), moved)
        placed = self.weights(key)
        src = weights.packed
        if src is not None and weights.layout is lay:  # packed alike: one copy (it converts the device)
            assert placed.packed is not None
            placed.packed.copy_(src, non_blocking=non_blocking)
            return Placement(placed, moved)
        for p in lay.pairs:  # copy_ converts dtype and device, and keeps the views' layout
            src_pair, dst_pair = weights.pairs[p.key], placed.pairs[p.key]
            dst_pair.a.copy_(src_pair.a, non_blocking=non_blocking)
            dst_pair.b.copy_(src_pair.b, non_blocking=non_blocking)
        return Placement(placed, moved)

    def free(self, key: str) -> None:
        """Give `key`'s bytes back (a no-op for an absent key). Its views must no longer be read
        (nor, for a key in flight, written)."""
        self.in_flight.discard(key)
        ext = self._extents.pop(key, None)
        if ext is not None:
            self.allocated_bytes -= ext.size
            self.used_bytes -= ext.actual

    def settle(self, key: str) -> None:
        """The asynchronous copy into reserved `key` has completed: it may move again."""
        self.in_flight.discard(key)

    # --- internals ------------------------------------------------------------------------------

    def _layout(self, weights: AdapterWeights) -> PackedLayout:
        # Weights packed at this element size carry their layout (the host tier's copies); others
        # are walked once: the most recent ones' layouts are kept, by object.
        if weights.layout is not None and weights.layout.elem == self.elem:
            return weights.layout
        hit = self._layouts.get(id(weights))
        if hit is not None and hit[0] is weights:
            return hit[1]
        result = pack_layout(weights, self.elem)
        if len(self._layouts) >= _LAYOUT_MEMO:
            del self._layouts[next(iter(self._layouts))]
        self._layouts[id(weights)] = (weights, result)
        return result

    def _ordered(self) -> list[tuple[str, _Extent]]:
        return sorted(self._extents.items(), key=lambda kv: kv[1].start)

    def _holes(self) -> list[tuple[int, int]]:
        """(start, size) of every free run, in address order (empty runs included, so hole i is
        the run before the i-th extent and the last one ends the pool)."""
        holes, pos = [], 0
        for _, ext in self._ordered():
            holes.append((pos, ext.start - pos))
            pos = ext.start + ext.size
        holes.append((pos, self.budget_bytes - pos))
        return holes

    def _best_fit(self, size: int) -> int | None:
        """Start of the smallest free run that holds `size` bytes (lowest address on ties)."""
        best: tuple[int, int] | None = None
        for start, run in self._holes():
            if run >= size and (best is None or run < best[1]):
                best = (start, run)
        return None if best is None else best[0]

    def _compact_for(
        self, size: int, key: str, fixed: frozenset[str]
    ) -> tuple[int, dict[str, AdapterWeights]]:
        """Make one free run of `size` bytes by sliding the live extents of the cheapest window
        down over its holes; returns the run's start and the moved adapters' new weights."""
        order = self._ordered()
        holes = [run for _, run in self._holes()]
        # Windows run from hole i to hole j and hold extents i..j-1, none fixed. For each j the best
        # window is the shortest one with enough free bytes; its left end only moves right.
        best: tuple[int, int, int] | None = None  # (live bytes to move, i, j)
        i, free, live = 0, 0, 0
        for j in range(len(holes)):
            if j > 0:
                prev_key, prev = order[j - 1]
                if prev_key in fixed:
                    i, free, live = j, 0, 0
                else:
                    live += prev.size
            free += holes[j]
            while i < j and free - holes[i] >= size:
                free -= holes[i]
                live -= order[i][1].size
                i += 1
            if free >= size and (best is None or live < best[0]):
                best = (live, i, j)
        if best is None:
            raise PoolFullError(self._full_message(key, size, fixed))
        _, i, j = best
        dst = order[i][1].start - holes[i] if i < len(order) else self.budget_bytes - holes[i]
        moved: dict[str, AdapterWeights] = {}
        for k, ext in order[i:j]:
            if ext.start != dst:
                self._move(ext.start, dst, ext.size)
                self.bytes_moved += ext.size
                ext.start = dst
                ext.generation += 1
                moved[k] = self.weights(k)
            dst += ext.size
        self.compactions += 1
        return dst, moved

    def _full_message(self, key: str, size: int, fixed: frozenset[str]) -> str:
        msg = (
            f"no room for adapter {key[:12]} in the adapter pool: it needs {size} bytes, {self.free_bytes} "
            f"of {self.budget_bytes} are free (largest free run {self.largest_free_extent} bytes)"
        )
        unmovable = [e.size for k, e in self._extents.items() if k in fixed]
        if size <= self.free_bytes and unmovable:
            msg += f"; {len(unmovable)} adapters that may not move now ({sum(unmovable)} bytes) split it"
        return msg

    def _move(self, src: int, dst: int, nbytes: int) -> None:
        """Copy bytes [src, src + nbytes) down to dst (dst < src; the ranges may overlap). torch
        refuses overlapping copies, so an overlapping move goes in chunks no longer than the
        distance (each chunk's source is read before anything writes it), or through a copy
        when that would take too many chunks."""
        flat, elem = self.buffer, self.elem
        s, d, n = src // elem, dst // elem, nbytes // elem
        step = s - d
        if step >= n:
            flat[d : d + n].copy_(flat[s : s + n])
        elif n <= 16 * step:
            for off in range(0, n, step):
                m = min(step, n - off)
                flat[d + off : d + off + m].copy_(flat[s + off : s + off + m])
        else:
            flat[d : d + n].copy_(flat[s : s + n].clone())

    def check_integrity(self) -> None:
        """Extents aligned, inside the budget, not overlapping; the byte counts add up."""
        pos = 0
        for key, ext in self._ordered():
            assert ext.start % ALIGN == 0 and ext.size % ALIGN == 0, (key, ext.start, ext.size)
            assert ext.start >= pos, (
                f"extent of {key[:12]} at {ext.start} overlaps the previous one ending {pos}"
            )
            pos = ext.start + ext.size
        assert pos <= self.budget_bytes, (pos, self.budget_bytes)
        assert self.allocated_bytes == sum(e.size for e in self._extents.values())
        assert self.used_bytes == sum(e.actual for e in self._extents.values())
