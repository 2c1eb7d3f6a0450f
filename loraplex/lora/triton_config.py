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

from dataclasses import dataclass, replace


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


DECODE = LoRATiling("decode", 16, 128, 16, 128, 512, 4, 4, 4, 3, 16)
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


def with_overrides(tiling: LoRATiling, **kw: int) -> LoRATiling:
    return replace(tiling, **kw)


def block_r_for(max_rank: int) -> int:
    """Register tile for the rank dimension: a power of two, at least 16 (`tl.dot`'s minimum)."""
    r = 16
    while r < max_rank:
        r *= 2
    return r
