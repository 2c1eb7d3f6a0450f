"""The device adapter pool: one preallocated region, each adapter stored at its exact ranks.

`AdapterPool(budget_bytes, dtype, device)` allocates one flat tensor up front (host memory on the
CPU) and never allocates on the serving path. Each placed adapter gets one contiguous *extent*
holding its pairs packed in (layer, target) order, A [r, d_in] then B [d_out, r], every tensor
row-major and starting on a 16-byte boundary (the kernels promise the compiler that alignment;
see `lora/triton_table.py`). Padding is only that alignment (at most 15 bytes per tensor), never
a rank padded to a global maximum, so allocated / actual bytes stays within a few per mille for
real shapes. The kernels address every A and B by an element offset from one base buffer, so a
pool tensor's views need no kernel change: the device table's offsets simply point into it.

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

from loraplex.lora.weights import AdapterWeights, LoRAPair, WeightFacts, adapted_groups

ALIGN = 16  # bytes: the start of every A and B (see `_ALIGN` in lora/triton_table.py)


class PoolFullError(RuntimeError):
    """No room for an adapter in the pool (the message says how many bytes, and why)."""


_LAYOUT_MEMO = 256  # adapters whose layout a pool remembers


def _round_up(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


@dataclass(frozen=True)
class _Pair:
    key: tuple[int, str]
    a_off: int  # bytes from the extent's start
    a_shape: tuple[int, int]
    b_off: int
    b_shape: tuple[int, int]
    scale: float


@dataclass
class _Extent:
    start: int  # bytes from the pool's start, a multiple of ALIGN
    size: int  # footprint: aligned bytes
    actual: int  # the pairs' own bytes
    pairs: tuple[_Pair, ...]
    facts: WeightFacts  # of the views: computed once per layout (`AdapterPool._layout`)
    generation: int = 0
    # the views at `start`, made once (hundreds of tensor views cost milliseconds of host time
    # on a load's path; reserve and commit both ask for them)
    cached: tuple[int, AdapterWeights] | None = None


def layout(weights: AdapterWeights, elem: int) -> tuple[tuple[_Pair, ...], int, int]:
    """Where each tensor of `weights` goes inside an extent of `elem`-byte elements, the extent's
    footprint and actual bytes; validates shapes before anything changes. The host tier packs its
    copies the same way, so a load is one contiguous copy (adapters/h2d_copy.py)."""
    pairs: list[_Pair] = []
    off = actual = 0
    for pkey in sorted(weights.pairs):
        pair = weights.pairs[pkey]
        if pair.a.dim() != 2 or pair.b.dim() != 2:
            raise ValueError(
                f"{pkey}: A and B must be 2-D, got {tuple(pair.a.shape)} and {tuple(pair.b.shape)}"
            )
        rank, d_in = (int(n) for n in pair.a.shape)
        d_out = int(pair.b.shape[0])
        if pair.b.shape[1] != rank:
            raise ValueError(f"{pkey}: B {tuple(pair.b.shape)} does not match A's rank {rank}")
        a_bytes, b_bytes = rank * d_in * elem, d_out * rank * elem
        pairs.append(_Pair(pkey, off, (rank, d_in), off + _round_up(a_bytes), (d_out, rank), pair.scale))
        off += _round_up(a_bytes) + _round_up(b_bytes)
        actual += a_bytes + b_bytes
    return tuple(pairs), off, actual


def layout_facts(pairs: tuple[_Pair, ...], actual: int) -> WeightFacts:
    """The facts of weights laid out as `pairs` with `actual` bytes (`layout`'s)."""
    ranks = {p.key: p.a_shape[0] for p in pairs}
    return WeightFacts(ranks, max(ranks.values(), default=0), actual, adapted_groups(ranks))


def views(
    flat: torch.Tensor,
    start: int,
    pairs: tuple[_Pair, ...],
    facts: WeightFacts | None = None,
    size: int | None = None,
) -> AdapterWeights:
    """The pairs of an extent starting `start` bytes into the 1-D tensor `flat`, as views;
    `facts`: theirs (`layout_facts`), known already; `size`: the extent's footprint, given to
    carry the extent's span as `packed`."""
    elem = flat.element_size()
    view = flat.as_strided  # one call per tensor (a slice then a view would be two)
    out = {}
    for p in pairs:
        ca, cb = p.a_shape[1], p.b_shape[1]
        a = view(p.a_shape, (ca, 1), (start + p.a_off) // elem)
        b = view(p.b_shape, (cb, 1), (start + p.b_off) // elem)
        out[p.key] = LoRAPair(a, b, p.scale)
    packed = None if size is None else flat[start // elem : (start + size) // elem]
    if facts is None:
        return AdapterWeights(out, packed)
    return AdapterWeights.with_facts(out, facts, packed)


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
        # id(weights) -> (weights, its layout, the facts of its views)
        self._layouts: dict[int, tuple[AdapterWeights, tuple[tuple[_Pair, ...], int, int], WeightFacts]] = {}
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
        return self._layout(weights)[1]

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
            ext.cached = (ext.start, views(self.buffer, ext.start, ext.pairs, ext.facts, ext.size))
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
        it returns the extent as a span (`packed`, no pairs: `weights(key)` makes the views).
        Raises `PoolFullError` (and changes nothing) when the room cannot be made, ValueError on
        malformed weights."""
        if key in self._extents:
            raise ValueError(f"adapter {key[:12]} is already in the pool")
        (pairs, size, actual), facts = self._layout_and_facts(weights)
        start = self._best_fit(size)
        moved: dict[str, AdapterWeights] = {}
        if start is None:
            start, moved = self._compact_for(size, key, frozenset(fixed) | self.in_flight)
        ext = _Extent(start, size, actual, pairs, facts)
        self._extents[key] = ext
        self.allocated_bytes += size
        self.used_bytes += actual
        if not copy:
            self.in_flight.add(key)
            return Placement(AdapterWeights({}, self.span(key)), moved)
        placed = self.weights(key)
        for p in pairs:  # copy_ converts dtype and device, and keeps the views' layout
            src = weights.pairs[p.key]
            placed.pairs[p.key].a.copy_(src.a, non_blocking=non_blocking)
            placed.pairs[p.key].b.copy_(src.b, non_blocking=non_blocking)
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

    def _layout(self, weights: AdapterWeights) -> tuple[tuple[_Pair, ...], int, int]:
        return self._layout_and_facts(weights)[0]

    def _layout_and_facts(
        self, weights: AdapterWeights
    ) -> tuple[tuple[tuple[_Pair, ...], int, int], WeightFacts]:
        # The host tier hands the same weights object to every reload of an adapter: its layout
        # and the facts of its views (passes over hundreds of pairs) are kept for the most recent.
        hit = self._layouts.get(id(weights))
        if hit is not None and hit[0] is weights:
            return hit[1], hit[2]
        result = layout(weights, self.elem)
        facts = layout_facts(result[0], result[2])
        if len(self._layouts) >= _LAYOUT_MEMO:
            del self._layouts[next(iter(self._layouts))]
        self._layouts[id(weights)] = (weights, result, facts)
        return result, facts

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
