"""Launch shapes of the LoRA kernels: a decode tiling and a prefill tiling.

Decode steps bring many segments of one or two rows, so the work is reading each adapter's A and
B once: 16-row tiles (the smallest `tl.dot` takes) and K split across programs so that a few
dozen segments still fill the GPU. Prefill steps bring long segments, so the work is streaming
X and Y: 64-row tiles reuse each A/B tile across many rows, and the K split is only used when
there are too few row tiles. `bench kernels` times both tilings on both shapes (its "tiling"
table), which is where the cut-over below comes from.

Pure Python (no triton import), so it is testable anywhere.
"""

from __future__ import annotations

from dataclasses import dataclass, fields


@dataclass(frozen=True)
class TwoLaunchTiling:
    """Tiles of the two-launch path: `lora_shrink_kernel`, then `lora_expand_kernel`. The prefill
    tiling is one; the decode tiling carries one for the decode-shaped calls the split launch does
    not take (see `DecodeTiling`)."""

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

    def __hash__(self) -> int:
        # part of the backend's per-call cache keys: hashed once, not over every field each call
        h = self.__dict__.get("_hash")
        if h is None:
            h = hash((type(self), *(getattr(self, f.name) for f in fields(self))))
            object.__setattr__(self, "_hash", h)
        return h


@dataclass(frozen=True)
class DecodeTiling(TwoLaunchTiling):
    """The decode path: the split launch, a shrink launch (`lora_shrink_pdl_kernel`) and an expand
    launch (`lora_expand_pdl_kernel`, or `lora_expand_rows_kernel` for wide groups with short
    segments) chained by programmatic dependent launch on CUDA, whose grid is planned to fill the
    GPU (`plan_split`). The shrink uses the two-launch fields' block_m, block_k and shrink_block_r.
    Calls it does not take (a rank tile past split_max_rank, more row tiles than the grid budget,
    more segments than the decode grid takes) run as two launches with the two-launch fields."""

    split_max_rank: int  # the split launch only when the step's rank tile is at most this
    # grid budget of the shrink launch, programs per SM: at any rank tile; at rank tile 16 (fewer,
    # longer K chunks pay there); at rank tile 16 for groups with d_in >= split_long_k_min (down)
    split_per_sm: int
    split_narrow_per_sm: int
    split_long_k_min: int
    split_long_k_per_sm: int
    split_max_k_chunks: int  # K chunks per row tile, at most
    split_min_k_steps: int  # K steps (block_k each) per chunk, at least
    split_block_n: int  # expand: columns per program
    split_shrink_warps: int
    split_expand_warps: int
    # pipeline stages of both launches; the shrink's at rank tile 16 (at most its K steps + 2)
    split_stages: int
    split_narrow_shrink_stages: int
    # the row-loop expand (row tiles spanning segments, a loop over their segments) for a group
    # whose adapted slices are at least this wide in all, at rank tiles up to row_loop_max_rank,
    # when segments average at most row_loop_max_avg_rows rows (a captured step: rows over
    # segment capacity); row_loop_block_n columns per program
    row_loop_min_width: int
    row_loop_max_rank: int
    row_loop_max_avg_rows: float
    row_loop_block_n: int

    __hash__ = TwoLaunchTiling.__hash__

    def per_sm_for(self, block_r: int, d_in: int) -> int:
        """Grid budget (programs per SM) for a step of this rank tile and a group of this d_in."""
        if block_r <= 16:
            return self.split_long_k_per_sm if d_in >= self.split_long_k_min else self.split_narrow_per_sm
        return self.split_per_sm

    def shrink_stages_for(self, block_r: int, k_steps: int) -> int:
        """Pipeline stages of the shrink launch (more buffers than K steps would only take shared
        memory). The stage count is a compile-time option, so K steps + 2 is rounded up to an even
        count: at most three variants (4, 6, 8 at the default) where every K step count was one."""
        if block_r <= 16:
            return min(self.split_narrow_shrink_stages, k_steps + 2 + (k_steps & 1))
        return self.split_stages


# The decode default (measured on an H200, docs/kernels.md): the split launch for every rank tile
# up to 64, with 2-warp shrink and 4-warp expand programs, 256-column expand tiles, 4 pipeline
# stages. The shrink takes the whole grid budget (expand programs start as shrink programs
# finish, so they need no share of it) and up to 32 K chunks. At rank tile 16 the shrink has a
# budget of 2 programs per SM (3 for down's d_in 14336) and up to 8 stages. gate_up (the only
# group 8192+ columns wide) at rank tile 16 with short segments takes the row-loop expand with
# 128-column tiles.
DECODE = DecodeTiling(
    block_m=16, block_k=128, shrink_block_r=16, block_n=128, n_chunk=512, shrink_warps=4, shrink_stages=4,
    expand_warps=4, expand_stages=3, max_split=16,
    split_max_rank=64, split_per_sm=6, split_narrow_per_sm=2, split_long_k_min=8192, split_long_k_per_sm=3,
    split_max_k_chunks=32, split_min_k_steps=2, split_block_n=256, split_shrink_warps=2, split_expand_warps=4,
    split_stages=4, split_narrow_shrink_stages=8,
    row_loop_min_width=8192, row_loop_max_rank=16, row_loop_max_avg_rows=4.0, row_loop_block_n=128,
)  # fmt: skip
PREFILL = TwoLaunchTiling(
    block_m=64, block_k=64, shrink_block_r=16, block_n=128, n_chunk=256, shrink_warps=4, shrink_stages=3,
    expand_warps=4, expand_stages=3, max_split=4,
)  # fmt: skip

# Longest segment up to this many rows: decode tiling. A 16-row tile wastes little on 1-2 rows;
# past a few tiles per segment the 64-row tiles re-read A/B 4x less often.
DECODE_MAX_SEG_ROWS = 32
# Longer segments still take the decode tiling while the step has at most this many 16-row tiles
# (segments x tiles per segment, rounded up to a power of two as the split launch pads them): a
# popular adapter's 64-256 rows in one segment give the prefill tiling 1-4 row tiles, so down's
# 14336-long K ran in 4 sequential chunks (about 76 µs a layer at 64 rows, where the split launch
# spreads K over a hundred programs). Past it, streaming X and Y through 64-row tiles wins.
DECODE_MAX_ROW_TILES = 16


def decode_row_tiles(max_seg_rows: int, segments: int) -> int:
    """Row tiles of the decode tiling's split launch: each segment padded to a power of two."""
    per_segment = -(-max_seg_rows // DECODE.block_m)
    return segments << (per_segment - 1).bit_length()


def pick_tiling(max_seg_rows: int, segments: int = 1) -> TwoLaunchTiling:
    """The tiling of a step whose longest of `segments` segments has `max_seg_rows` rows."""
    if max_seg_rows <= DECODE_MAX_SEG_ROWS:
        return DECODE
    return DECODE if decode_row_tiles(max_seg_rows, segments) <= DECODE_MAX_ROW_TILES else PREFILL


@dataclass(frozen=True)
class ShrinkSplit:
    n_split: int
    k_chunk: int


def split_k(tiling: TwoLaunchTiling, d_in: int, programs: int, num_sms: int) -> ShrinkSplit:
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
class SplitPlan:
    """Grids of the split launch: n_shrink shrink programs (row tile x K chunk x rank chunk), then
    per row tile sum(chunks) expand programs of block_n columns each."""

    split: ShrinkSplit
    block_n: int
    chunks: tuple[int, int, int]  # expand programs per row tile for slice 0, 1, 2 (0: none)
    n_shrink: int
    n_expand: int


def plan_split(
    tiling: DecodeTiling,
    tiles: int,
    r_chunks: int,
    d_in: int,
    widths: tuple[int, ...],
    block_r: int,
    num_sms: int,
) -> SplitPlan | None:
    """The split launch's grids for `tiles` row tiles, or None when even one K chunk per row tile
    needs more shrink programs than the grid budget (num_sms x `per_sm_for`).

    widths: the output width of each slice that some adapter of the step adapts (0 for the others).
    K is split as finely as the budget allows (any count, not only powers of two), keeping each
    chunk at least `split_min_k_steps` K steps long: the shrink's K loops are what the expand
    programs wait for.
    """
    budget = num_sms * tiling.per_sm_for(block_r, d_in)
    want = budget // max(tiles * r_chunks, 1)
    block_n = tiling.split_block_n
    chunks = [_cdiv(w, block_n) for w in widths]
    most = d_in // (tiling.split_min_k_steps * tiling.block_k)
    for n_split in range(max(1, min(want, tiling.split_max_k_chunks, most)), 0, -1):
        chunk = _cdiv(_cdiv(d_in, n_split), tiling.block_k) * tiling.block_k
        split = ShrinkSplit(_cdiv(d_in, chunk), chunk)
        n_shrink = tiles * r_chunks * split.n_split
        if n_shrink > budget:
            continue
        padded = (chunks + [0, 0, 0])[:3]
        return SplitPlan(split, block_n, (padded[0], padded[1], padded[2]), n_shrink, tiles * sum(chunks))
    return None


def row_loop_applies(
    tiling: DecodeTiling, rows: int, segments: int, block_r: int | None = None, width: int | None = None
) -> bool:
    """Whether the row-loop expand may serve a step of `rows` LoRA rows in `segments` segments
    (segments short enough that a row tile spans several), and, given, a call of that rank tile
    whose adapted slices are `width` columns wide in all."""
    if segments == 0 or rows > tiling.row_loop_max_avg_rows * segments:
        return False
    if block_r is not None and block_r > tiling.row_loop_max_rank:
        return False
    return width is None or width >= tiling.row_loop_min_width


def split_cap(n_split: int, most: int = 1 << 30) -> int:
    """The expand kernels' unrolled partial loads for a shrink of n_split K chunks: the next power
    of two, at least 8 (and at most the next power of two of `most`, the tiling's own bound). A
    compile-time constant, so bucketed: three variants (8, 16, 32) where every split count was
    one; the loads past n_split are predicated off (no bytes, a few instructions each)."""
    cap = max(8, 1 << (max(n_split, 1) - 1).bit_length())
    return min(cap, 1 << (max(most, 1) - 1).bit_length())


def block_r_for(max_rank: int) -> int:
    """Register tile for the rank dimension: a power of two, at least 16 (`tl.dot`'s minimum)."""
    r = 16
    while r < max_rank:
        r *= 2
    return r
