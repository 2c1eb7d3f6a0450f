"""Launch shapes of the LoRA kernels: one kernel pair, two tilings (decode-shaped and prefill-shaped).

Decode steps bring many segments of one or two rows, so the work is reading each adapter's A and
B once: 16-row tiles (the smallest `tl.dot` takes) and K split across programs so that a few
dozen segments still fill the GPU. Prefill steps bring long segments, so the work is streaming
X and Y: 64-row tiles reuse each A/B tile across many rows, and the K split is only used when
there are too few row tiles. `bench kernels` times both tilings on both shapes (its "tiling"
table), which is where the cut-over below comes from.

Pure Python (no triton import), so it is testable anywhere.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import Any


@dataclass(frozen=True)
class LoRATiling:
    name: str
    block_m: int  # rows per program (both kernels)
    block_k: int  # shrink: K step
    shrink_block_r: int  # shrink: rank columns per program (larger ranks get more programs)
    block_n: int  # expand: column step
    n_chunk: int  # expand: columns per program (a multiple of block_n)
    shrink_warps: int
    shrink_stages: int
    expand_warps: int
    expand_stages: int
    max_split: int  # shrink: most K chunks per row tile
    # One launch per call (shrink and expand programs in one grid, see `plan_fused`) when the
    # grid fits on the GPU at once; otherwise the two-launch path above.
    fused: bool = False
    fused_max_rank: int = 16  # fused only when the step's rank tile is at most this (see docs/kernels.md)
    fused_max_split: int = 16  # K chunks per row tile in the fused grid
    fused_min_k_steps: int = 2  # K steps (block_k each) per chunk, at least
    fused_block_n: int = 256  # expand: columns per tile (fewer for large rank tiles: fused_tile_elems)
    fused_tile_elems: int = 4096  # expand: most elements of one B tile (block_r x block_n)
    fused_per_sm: int = 6  # fused grid budget: programs per SM (checked against the compiled kernel)
    fused_max_sub: int = 64  # expand: most tiles per program
    # 0: every program of the fused grid resident at once (expand tiles per program grow until the
    # grid fits). > 0: each expand program takes this many tiles and only the shrink programs must
    # fit at once; expand programs past the resident set start as earlier programs finish. Safe
    # because programs are dispatched in launch order and shrink programs come first and never
    # wait, so every program an expand program waits for is already resident.
    fused_expand_sub: int = 0
    # bounds of the shrink programs' share of the fused grid budget (the share itself follows the
    # bytes each side streams); with streamed expand programs the share only caps the K split
    fused_min_share: float = 0.2
    fused_max_share: float = 0.8
    fused_warps: int = 4
    fused_stages: int = 3
    # Programmatic dependent launch: a fused call may start (metadata and weight loads) while the
    # kernel before it finishes; activations, h and counters are touched only after it has.
    pdl: bool = False
    # the next call may start once all of this one's programs have started (else: once all are
    # past their waits, i.e. only the expand tail is left)
    pdl_early: bool = False
    # the fused plan's shrink and expand programs as two launches (PDL lets the expand launch load
    # its B tiles while the shrink runs); the launch boundary replaces the counters and spinning
    fused_split_launch: bool = False
    # split launch only: warps of the expand launch (0: fused_warps), which needs far fewer
    # registers than the shrink
    split_expand_warps: int = 0
    # split launch only: kernels read per-step segment tables (gathered by `begin_step`, one
    # column per segment) instead of the slot tables, one dependent load fewer per program
    seg_tables: bool = False
    # split launch only: a group whose adapted slices are at least this wide in all (0: never)
    # takes the row-loop expand (`lora_expand_rows_kernel`: 16-row tiles spanning segments, a
    # loop over their segments), with B tiles of at most row_loop_tile_elems elements
    row_loop_min_width: int = 0
    row_loop_tile_elems: int = 4096
    row_loop_max_rank: int = 64  # ... and only when the step's rank tile is at most this
    # ... and segments average at most this many rows (a row tile spans several segments; a
    # captured step: rows over segment capacity)
    row_loop_max_avg_rows: float = 4.0
    row_loop_stages: int = 0  # pipeline stages of the row-loop expand (0: fused_stages)
    row_loop_warps: int = 0  # warps of the row-loop expand (0: those of the split launch's expand)
    # registers per thread the row-loop expand may use (0: the compiler's choice): all of gate_up's
    # programs resident at once (one wave) needs at most 72 at 4 warps
    row_loop_maxnreg: int = 0
    # the row-loop expand loads its first segment's B tile before the PDL wait (the loop then
    # starts at the second)
    row_loop_early_b: bool = False
    # the row-loop expand (on CUDA) reads its table entries with loads the compiler's pipeliner
    # does not stage, so that B is its only pipelined load (see `_ld_opaque`)
    row_loop_table_asm: bool = False
    split_shrink_stages: int = 0  # pipeline stages of the split launch's shrink (0: fused_stages)
    # split launch: the expand adds into Y with one atomic add per element instead of a read and
    # a write (no read round trip after the wait; Y's dtype rounds the LoRA term first)
    atomic_y: bool = False
    # at rank tile 16 only (0: as at any rank tile): the grid budget per SM and the split shrink's
    # stages. There, fewer and longer shrink programs with deeper pipelines pay; at larger rank
    # tiles each K chunk is several rank-chunk programs, and the same budget leaves too few chunks.
    narrow_per_sm: int = 0
    narrow_shrink_stages: int = 0
    # ... except for groups whose d_in is at least long_k_min (down: 14336), which get a budget
    # of long_k_per_sm (0: the rank tile's): more, shorter K chunks for the long reduction
    long_k_min: int = 0
    long_k_per_sm: int = 0

    @property
    def reads_segment_tables(self) -> bool:
        """Whether its decode calls read per-step segment tables (only the fused split launch does)."""
        return self.seg_tables and self.fused and self.fused_split_launch

    def per_sm_for(self, block_r: int, d_in: int = 0) -> int:
        """Fused grid budget (programs per SM) for a step of this rank tile and a group of this d_in."""
        if self.long_k_min and self.long_k_per_sm and d_in >= self.long_k_min and block_r <= 16:
            return self.long_k_per_sm
        return self.narrow_per_sm if block_r <= 16 and self.narrow_per_sm else self.fused_per_sm

    def shrink_stages_for(self, block_r: int, k_steps: int | None = None) -> int:
        """Pipeline stages of the split launch's shrink for a step of this rank tile; the narrow
        setting at most k_steps + 2 (more buffers than K steps would only take shared memory)."""
        if block_r <= 16 and self.narrow_shrink_stages:
            return min(self.narrow_shrink_stages, k_steps + 2) if k_steps else self.narrow_shrink_stages
        return self.split_shrink_stages or self.fused_stages

    def __hash__(self) -> int:
        # part of the backend's per-call cache keys: hashed once, not over ~35 fields every call
        h = self.__dict__.get("_hash")
        if h is None:
            h = hash(tuple(getattr(self, f.name) for f in fields(self)))
            object.__setattr__(self, "_hash", h)
        return h


# The decode default (measured on an H200, docs/kernels.md): the fused plan as two PDL launches
# (shrink with 2 warps, expand with 4), for every rank tile up to 64, expand tiles of 256 columns
# at any rank tile, 4 pipeline stages. The shrink takes the whole grid budget (its expand programs
# are streamed, so they need no share of it) and up to 32 K chunks: its K loops are what the
# expand programs wait for. gate_up (the only group 8192+ columns wide) at rank tile 16 with
# short segments takes the row-loop expand with 128-column tiles. The expands add into Y with
# atomic adds (no read of Y). At rank tile 16 the shrink has a budget of 2 programs per SM (fewer,
# longer K chunks) and up to 8 pipeline stages, except down (d_in 14336), which gets 3 per SM. The
# kernels read per-step segment tables (`begin_step` gathers them), one dependent load fewer per
# program. The row-loop expand reads its table entries with loads the pipeliner leaves alone (B
# tiles 3 ahead instead of one at a time) and loads its first B tile before the PDL wait.
DECODE = LoRATiling(
    "decode", 16, 128, 16, 128, 512, 4, 4, 4, 3, 16, fused=True, pdl=True, fused_expand_sub=1,
    fused_min_share=1.0, fused_max_share=1.0, fused_max_split=32, fused_warps=2, fused_split_launch=True,
    split_expand_warps=4, fused_max_rank=64, fused_tile_elems=16384, fused_stages=4,
    row_loop_min_width=8192, row_loop_max_rank=16, row_loop_tile_elems=2048, atomic_y=True,
    narrow_per_sm=2, narrow_shrink_stages=8, seg_tables=True, long_k_min=8192, long_k_per_sm=3,
    row_loop_early_b=True, row_loop_table_asm=True,
)  # fmt: skip
PREFILL = LoRATiling("prefill", 64, 64, 16, 128, 256, 4, 3, 4, 3, 4)
TILINGS = {t.name: t for t in (DECODE, PREFILL)}

# Longest segment up to this many rows: decode tiling. A 16-row tile wastes little on 1-2 rows;
# past a few tiles per segment the 64-row tiles re-read A/B 4x less often.
DECODE_MAX_SEG_ROWS = 32


def pick_tiling(max_seg_rows: int) -> LoRATiling:
    return DECODE if max_seg_rows <= DECODE_MAX_SEG_ROWS else PREFILL


@dataclass(frozen=True)
class ShrinkSplit:
    n_split: int
    k_chunk: int


def split_k(tiling: LoRATiling, d_in: int, programs: int, num_sms: int) -> ShrinkSplit:
    """Split d_in so that about two programs per SM are in flight (bandwidth needs many loads
    outstanding), keeping each chunk at least two K steps long."""
    want = max(1, -(-2 * num_sms // max(programs, 1)))
    most = max(1, d_in // (2 * tiling.block_k))
    n = min(want, most, tiling.max_split)
    n = 1 << (n.bit_length() - 1)  # powers of two: the split is a compile-time constant, keep variants few
    chunk = -(-d_in // n)
    chunk = -(-chunk // tiling.block_k) * tiling.block_k
    return ShrinkSplit(-(-d_in // chunk), chunk)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class FusedPlan:
    """Launch shape of the one-launch path: n_shrink shrink programs (row tile x K split x rank
    chunk), then per row tile sum(chunks) expand programs of block_n * n_sub columns each."""

    split: ShrinkSplit
    block_n: int
    n_sub: int
    chunks: tuple[int, int, int]  # expand programs per row tile for slice 0, 1, 2 (0: none)
    n_shrink: int
    n_expand: int

    streamed: bool = False  # expand programs need not be resident at once (fused_expand_sub > 0)

    @property
    def programs(self) -> int:
        return self.n_shrink + self.n_expand

    @property
    def resident(self) -> int:
        """Programs that must be resident at once for the launch to be deadlock-free."""
        return self.n_shrink if self.streamed else self.programs


def plan_fused(
    tiling: LoRATiling,
    tiles: int,
    r_chunks: int,
    d_in: int,
    widths: tuple[int, ...],
    block_r: int,
    num_sms: int,
    per_sm: int | None = None,
) -> FusedPlan | None:
    """Fused grid for `tiles` row tiles, or None when it would not fit in num_sms * per_sm programs.

    widths: the output width of each slice that some adapter of the step adapts (0 for the others).
    Expand programs take whole slices' columns in equal chunks; the tiles per program (n_sub) grow
    until the grid fits, and each program's later tiles are pipelined by the compiler.
    """
    if not tiling.fused:
        return None
    budget = num_sms * (per_sm if per_sm is not None else tiling.per_sm_for(block_r, d_in))
    # The grid is shared in proportion to the bytes each side streams (A: d_in per adapted slice,
    # B: the slices' widths; the rank cancels), so shrink and expand programs carry similar loads.
    # K is split as finely as the shrink share allows (any count, not only powers of two),
    # keeping each chunk at least `fused_min_k_steps` K steps long.
    a_cols = d_in * sum(1 for w in widths if w)
    share = min(tiling.fused_max_share, max(tiling.fused_min_share, a_cols / (a_cols + sum(widths))))
    want = int(budget * share) // max(tiles * r_chunks, 1)
    block_n = max(16, min(tiling.fused_block_n, tiling.fused_tile_elems // block_r))
    n_tiles = [_cdiv(w, block_n) for w in widths]
    # fewer K chunks when the expand programs would not fit otherwise
    most = d_in // (tiling.fused_min_k_steps * tiling.block_k)
    for n_split in range(max(1, min(want, tiling.fused_max_split, most)), 0, -1):
        chunk = _cdiv(_cdiv(d_in, n_split), tiling.block_k) * tiling.block_k
        split = ShrinkSplit(_cdiv(d_in, chunk), chunk)
        n_shrink = tiles * r_chunks * split.n_split
        if tiling.fused_expand_sub > 0:
            if n_shrink > budget:
                continue
            n_sub = tiling.fused_expand_sub
            chunks = [_cdiv(t, n_sub) for t in n_tiles]
            padded = (chunks + [0, 0, 0])[:3]
            return FusedPlan(
                split, block_n, n_sub, (padded[0], padded[1], padded[2]), n_shrink, tiles * sum(chunks), True
            )
        for n_sub in range(1, tiling.fused_max_sub + 1):
            chunks = [_cdiv(t, n_sub) for t in n_tiles]
            n_expand = tiles * sum(chunks)
            if n_shrink + n_expand <= budget:
                # the fewest tiles per program that keeps these chunk counts (even chunks)
                n_sub = max((_cdiv(t, c) for t, c in zip(n_tiles, chunks, strict=True) if c), default=1)
                padded = (chunks + [0, 0, 0])[:3]
                return FusedPlan(split, block_n, n_sub, (padded[0], padded[1], padded[2]), n_shrink, n_expand)
    return None


def row_loop_applies(
    tiling: LoRATiling, rows: int, segments: int, block_r: int | None = None, width: int | None = None
) -> bool:
    """Whether the row-loop expand may serve a step of `rows` LoRA rows in `segments` segments
    (segments short enough that a row tile spans several), and, given, a call of that rank tile
    whose adapted slices are `width` columns wide in all."""
    if not tiling.row_loop_min_width or segments == 0 or rows > tiling.row_loop_max_avg_rows * segments:
        return False
    if block_r is not None and block_r > tiling.row_loop_max_rank:
        return False
    return width is None or width >= tiling.row_loop_min_width


def with_overrides(tiling: LoRATiling, **kw: Any) -> LoRATiling:
    return replace(tiling, **kw)


def block_r_for(max_rank: int) -> int:
    """Register tile for the rank dimension: a power of two, at least 16 (`tl.dot`'s minimum)."""
    r = 16
    while r < max_rank:
        r *= 2
    return r


def blocks_per_sm(regs_per_thread: int, shared_bytes: int, num_warps: int, props: object) -> int:
    """Programs of one kernel that fit on one SM at once, from its compiled resource use.

    props: `torch.cuda.get_device_properties` (Hopper defaults where an attribute is missing).
    Registers go to warps in units of 256; each program's shared memory carries 1 KiB reserved by
    the system. A conservative count: the fused path needs every program resident.
    """
    regs_sm = getattr(props, "regs_per_multiprocessor", 65536)
    smem_sm = getattr(props, "shared_memory_per_multiprocessor", 233472)
    threads_sm = getattr(props, "max_threads_per_multi_processor", 2048)
    regs_warp = -(-max(regs_per_thread, 1) * 32 // 256) * 256
    by_regs = (regs_sm // regs_warp) // num_warps
    by_smem = smem_sm // (shared_bytes + 1024)
    by_threads = threads_sm // (32 * num_warps)
    return max(0, min(by_regs, by_smem, by_threads, 32))
