"""Triton kernels of the segmented LoRA op: shrink (H = X_a A_a^T) and expand (Y += s_a H B_a^T),
each its own launch: the two-launch pair here (`lora_shrink_kernel`, `lora_expand_kernel`;
prefill, and the decode calls the split launch does not take) and the split launch of decode steps
in `triton_split` (`lora_shrink_pdl_kernel`, then `lora_expand_pdl_kernel` or
`lora_expand_rows_kernel`, chained by programmatic dependent launch on CUDA), re-exported here.
The helpers they share, and what is (and is not) a compile-time specialization, are in
`triton_parts`.

Imported only by `ops_triton` (lazily), so `import loraplex.lora` works without triton.

Weights are rank-exact: every (slice, slot) entry of the pointer tables points at that adapter's
own A [r, d_in] and B [d_out, r] (row-major, 16-byte aligned, r a multiple of 8; see
`triton_table`), and the rank table says how many rows of A / columns of B exist. BLOCK_R is only
the register tile: loads past an adapter's rank are masked off, so they move no bytes.

Every kernel takes the group's slices (q/k/v or gate/up) in one launch; `slice_mask` (runtime)
says which of them some adapter of the step adapts (the others read no weights).
"""

from __future__ import annotations

import triton
import triton.language as tl

from loraplex.lora.triton_parts import (
    _dot,
    _shrink_tile,
    _slice_columns,
    _slice_entries,
    _slice_entry,
    _sum_partials,
)
from loraplex.lora.triton_split import lora_expand_pdl_kernel, lora_expand_rows_kernel, lora_shrink_pdl_kernel

# The values that change from step to step (row and segment counts, table capacity, which slices
# are adapted, the K split) are runtime values, so an eager step of any shape compiles nothing new
# once the (tiling, group, rank tile) variants are warm; the table views are not alignment-specialized.
_RUNTIME = ["n_slots", "num_rows", "row_tiles", "slice_mask", "n_split"]
_TABLES = ["seg_slots_ptr", "a_tab", "b_tab", "rank_tab", "scale_tab", "row_perm_ptr", "seg_offsets_ptr"]


@triton.jit(do_not_specialize=_RUNTIME, do_not_specialize_on_alignment=_TABLES)
def lora_shrink_kernel(
    x_ptr,  # x: [T, d_in]
    w_base,  # the weight table's base buffer; a_tab holds element offsets from it
    h_ptr,  # h: [n_split, N_SLICES, R, BLOCK_R] float32 partial sums over K chunks
    row_perm_ptr,  # [R] int64
    seg_offsets_ptr,  # [S + 1] int64
    seg_slots_ptr,  # [S] int64
    a_tab,  # [N_SLICES, n_slots] int64 element offsets of A from w_base
    rank_tab,  # [N_SLICES, n_slots] int32
    n_slots,
    d_in,
    stride_xm,
    num_rows,  # R
    row_tiles,  # row tiles per segment (the longest segment's)
    slice_mask,  # bit i: some adapter of the step adapts slice i
    k_chunk,  # K columns per split, a multiple of BLOCK_K
    N_SLICES: tl.constexpr,
    W_ALIGN: tl.constexpr,  # elements per 16 bytes
    BLOCK_M: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_R: tl.constexpr,  # width of h's rank planes (covers the step's largest rank)
    BLOCK_RC: tl.constexpr,  # rank columns per program
    FOR_LOOP: tl.constexpr,  # the K loop as a counted loop (CUDA) or a while loop (interpreter)
):
    # grid: (S * row_tiles * BLOCK_R // BLOCK_RC, n_split); one program = one row tile of one
    # segment, one chunk of rank columns, one K chunk, all slices. Splitting the rank keeps every
    # program's share of A the same size whatever the adapter's rank, so mixed ranks balance and
    # a rank-64 adapter does not make every program carry 64-wide tiles.
    R_CHUNKS: tl.constexpr = BLOCK_R // BLOCK_RC
    pid = tl.program_id(0) // R_CHUNKS
    rc = tl.program_id(0) % R_CHUNKS  # fastest-varying: programs sharing an X tile run together
    split = tl.program_id(1)
    seg = pid // row_tiles
    # Latency, not bandwidth, bounds a decode step's small programs: issue every metadata load
    # that does not depend on another before the first branch, so the chain before the weight
    # loads is two round trips (segment + slot, then table + rows), not four.
    seg_lo = tl.load(seg_offsets_ptr + seg)
    seg_hi = tl.load(seg_offsets_ptr + seg + 1)
    slot = tl.load(seg_slots_ptr + seg)
    a0, r0, a1, r1, a2, r2, r_max = _slice_entries(
        w_base, a_tab, rank_tab, n_slots, slot, slice_mask, N_SLICES, W_ALIGN
    )
    m0 = seg_lo + (pid % row_tiles) * BLOCK_M
    if m0 >= seg_hi:  # shorter segments leave tail tiles empty (also: zero-length padding segments)
        return
    if rc * BLOCK_RC >= r_max:  # past this adapter's rank in every slice: nothing to read or write
        return
    offs_m = m0 + tl.arange(0, BLOCK_M)
    m_mask = offs_m < seg_hi
    rows = tl.load(row_perm_ptr + offs_m, mask=m_mask, other=0)
    offs_r = rc * BLOCK_RC + tl.arange(0, BLOCK_RC)
    _shrink_tile(
        x_ptr, h_ptr, rows, offs_m, m_mask, offs_r, split, k_chunk, a0, r0, a1, r1, a2, r2, d_in, stride_xm,
        num_rows, N_SLICES, BLOCK_M, BLOCK_K, BLOCK_R, BLOCK_RC, FOR_LOOP,
    )  # fmt: skip


@triton.jit(do_not_specialize=_RUNTIME, do_not_specialize_on_alignment=_TABLES)
def lora_expand_kernel(
    y_ptr,  # y: [T, d_out_total], updated in place
    w_base,
    h_ptr,  # h: [n_split, N_SLICES, R, BLOCK_R] float32, from the shrink kernel
    row_perm_ptr,  # [R] int64
    seg_offsets_ptr,  # [S + 1] int64
    seg_slots_ptr,  # [S] int64
    b_tab,  # [N_SLICES, n_slots] int64 element offsets of B from w_base
    rank_tab,  # [N_SLICES, n_slots] int32
    scale_tab,  # [N_SLICES, n_slots] float32
    n_slots,
    stride_ym,
    num_rows,  # R
    row_tiles,
    col0,  # slice i occupies columns [col_i, col_{i+1})
    col1,
    col2,
    col3,
    slice_mask,
    n_split,  # K chunks the shrink wrote partials for
    N_SLICES: tl.constexpr,
    W_ALIGN: tl.constexpr,
    COLS_ALIGNED: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_R: tl.constexpr,
    N_SPLIT: tl.constexpr,  # the unrolled partial loads, >= n_split (the tiling's max_split)
    N_CHUNK: tl.constexpr,  # output columns per program, a multiple of BLOCK_N
):
    # grid: (S * row_tiles, column chunks of the widest slice, N_SLICES)
    pid = tl.program_id(0)
    chunk = tl.program_id(1)
    i = tl.program_id(2)
    if ((slice_mask >> i) & 1) == 0:
        return
    seg = pid // row_tiles
    seg_lo = tl.load(seg_offsets_ptr + seg)  # as in the shrink: independent loads first
    seg_hi = tl.load(seg_offsets_ptr + seg + 1)
    slot = tl.load(seg_slots_ptr + seg)
    b_ptr, rank = _slice_entry(w_base, b_tab, rank_tab, n_slots, slot, i, W_ALIGN)
    scale = tl.load(scale_tab + i * n_slots + slot)
    m0 = seg_lo + (pid % row_tiles) * BLOCK_M
    offs_m = m0 + tl.arange(0, BLOCK_M)
    m_mask = offs_m < seg_hi
    rows = tl.load(row_perm_ptr + offs_m, mask=m_mask, other=0)
    offs_r = tl.arange(0, BLOCK_R)
    # h: no wait on the rank (columns past it, which the shrink may not have written, are zeroed
    # after the load)
    h = _sum_partials(
        h_ptr, i, num_rows, n_split, offs_m, m_mask, offs_r, N_SLICES, N_SPLIT, BLOCK_M, BLOCK_R, False
    )
    if m0 >= seg_hi:
        return
    col_lo, col_hi = _slice_columns(i, col0, col1, col2, col3, COLS_ALIGNED)
    n_lo = chunk * N_CHUNK
    width = col_hi - col_lo
    if n_lo >= width:  # narrower slices (k, v next to q) have fewer chunks
        return
    if rank == 0:  # this segment's adapter does not adapt this slice
        return
    r_mask = offs_r < rank
    # scale folded in before the low-precision dot
    h = (tl.where(r_mask[None, :], h, 0.0) * scale).to(y_ptr.dtype.element_ty)

    y_rows = y_ptr + rows[:, None] * stride_ym + col_lo
    for nn in range(0, N_CHUNK, BLOCK_N):
        offs_n = n_lo + nn + tl.arange(0, BLOCK_N)
        n_mask = offs_n < width
        # Y first: its load does not wait for the dot, so both loads are in flight together.
        y_mask = m_mask[:, None] & n_mask[None, :]
        yt = tl.load(y_rows + offs_n[None, :], mask=y_mask, other=0.0)
        # b: [d_out_i, r] row-major; tile [BLOCK_R, BLOCK_N] is one contiguous run of BLOCK_N * r values
        b_mask = r_mask[:, None] & n_mask[None, :]
        bt = tl.load(b_ptr + offs_n[None, :] * rank + offs_r[:, None], mask=b_mask, other=0.0)
        delta = _dot(h, bt, None)  # [BLOCK_M, BLOCK_N] float32
        tl.store(y_rows + offs_n[None, :], (yt.to(tl.float32) + delta).to(yt.dtype), mask=y_mask)


def shrink_grid(num_segments: int, row_tiles: int, n_split: int) -> tuple[int, int]:
    return (num_segments * row_tiles, n_split)


def expand_grid(num_segments: int, row_tiles: int, n_chunks: int, n_slices: int) -> tuple[int, int, int]:
    return (num_segments * row_tiles, n_chunks, n_slices)


__all__ = [
    "lora_expand_kernel",
    "lora_expand_pdl_kernel",
    "lora_expand_rows_kernel",
    "lora_shrink_pdl_kernel",
    "lora_shrink_kernel",
    "shrink_grid",
    "expand_grid",
    "triton",
]
