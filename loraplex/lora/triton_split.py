"""The split launch of decode steps: `lora_shrink_pdl_kernel`, then `lora_expand_pdl_kernel` or
`lora_expand_rows_kernel`, two launches chained by programmatic dependent launch on CUDA, with grids
planned to fill the GPU (`triton_config.plan_split`). Shared helpers and the specialization rules:
`triton_parts`. Imported through `triton_kernels`.
"""

from __future__ import annotations

import triton
import triton.language as tl

from loraplex.lora.triton_parts import (
    _add_y,
    _chunk_slice,
    _dot,
    _ld_opaque,
    _shrink_tile,
    _slice_columns,
    _slice_entries,
    _slice_entry,
    _slot_or_segment,
    _sum_partials,
)

# The kernels below take the values that differ between the decode graphs captured at startup
# and between eager steps (segment capacity, bucket rows, table pointers that are views at
# per-step offsets, the split plan's K chunk and split count, the adapted slices) as plain runtime
# values: specializing on them (== 1, divisible by 16, 16-byte aligned, constexprs) compiled 268
# variants for the graph keys of the 8B shapes at max batch 64, and eager steps kept adding more.
# N_SPLIT, the expands' unrolled partial loads, is bucketed (`triton_config.split_cap`).
# Row tiles per segment come as a shift (a power of two: `ops_triton` rounds them up), one
# instruction where a runtime division would add a dozen before the first metadata load.
_RUNTIME = ["n_slots", "num_rows", "row_shift", "slice_mask", "n_split", "ch1", "ch2", "n_chunks", "n_segs"]


@triton.jit(
    do_not_specialize=_RUNTIME,
    do_not_specialize_on_alignment=["seg_slots_ptr", "a_tab", "rank_tab"],
)
def lora_shrink_pdl_kernel(
    x_ptr, w_base, h_ptr, row_perm_ptr, seg_offsets_ptr, seg_slots_ptr, a_tab, rank_tab, n_slots, d_in,
    stride_xm, num_rows, row_shift, slice_mask, k_chunk,
    N_SLICES: tl.constexpr, W_ALIGN: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_RC: tl.constexpr, USE_PDL: tl.constexpr, SEG_TABLES: tl.constexpr,
    FOR_LOOP: tl.constexpr,
):  # fmt: skip
    """The split launch's shrink (grid: (row tiles x rank chunks, K chunks), planned to fill the
    GPU by `triton_config.plan_split`), handing h to `lora_expand_pdl_kernel` (or
    `lora_expand_rows_kernel`) through the launch boundary. With PDL the expand launch may start
    at once: its programs load their B tiles while these run."""
    if USE_PDL:
        tl.extra.cuda.gdc_launch_dependents()
    pid = tl.program_id(0)
    # pid -> (row tile, rank chunk), rank chunk fastest: programs sharing an X tile adjacent. The K
    # split is the grid's second axis, so the split count (runtime) costs no division here.
    R_CHUNKS: tl.constexpr = BLOCK_R // BLOCK_RC
    rc = pid % R_CHUNKS
    split = tl.program_id(1)
    tile = pid // R_CHUNKS
    seg = tile >> row_shift
    seg_lo = tl.load(seg_offsets_ptr + seg)
    seg_hi = tl.load(seg_offsets_ptr + seg + 1)
    slot = _slot_or_segment(seg_slots_ptr, seg, SEG_TABLES)
    a0, r0, a1, r1, a2, r2, r_max = _slice_entries(
        w_base, a_tab, rank_tab, n_slots, slot, slice_mask, N_SLICES, W_ALIGN
    )
    m0 = seg_lo + (tile & ((1 << row_shift) - 1)) * BLOCK_M
    offs_m = m0 + tl.arange(0, BLOCK_M)
    m_mask = offs_m < seg_hi
    rows = tl.load(row_perm_ptr + offs_m, mask=m_mask, other=0)
    offs_r = rc * BLOCK_RC + tl.arange(0, BLOCK_RC)
    if USE_PDL:
        # Everything above reads only metadata and weights; X and h may still be in use by the
        # kernel this one overlaps, so they wait for it to finish.
        tl.extra.cuda.gdc_wait()
    if (m0 < seg_hi) & (rc * BLOCK_RC < r_max):
        _shrink_tile(
            x_ptr, h_ptr, rows, offs_m, m_mask, offs_r, split, k_chunk, a0, r0, a1, r1, a2, r2, d_in,
            stride_xm, num_rows, N_SLICES, BLOCK_M, BLOCK_K, BLOCK_R, BLOCK_RC, FOR_LOOP,
        )  # fmt: skip


@triton.jit(
    do_not_specialize=_RUNTIME,
    do_not_specialize_on_alignment=["seg_slots_ptr", "b_tab", "rank_tab", "scale_tab"],
)
def lora_expand_pdl_kernel(
    y_ptr, w_base, h_ptr, row_perm_ptr, seg_offsets_ptr, seg_slots_ptr, b_tab, rank_tab, scale_tab, n_slots,
    stride_ym, num_rows, row_shift, col0, col1, col2, col3, ch1, ch2, n_chunks, n_split,
    N_SLICES: tl.constexpr, W_ALIGN: tl.constexpr, COLS_ALIGNED: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr, N_SPLIT: tl.constexpr,
    USE_PDL: tl.constexpr, SEG_TABLES: tl.constexpr,
):  # fmt: skip
    """The split launch's expand (grid: row tiles x column tiles of the adapted slices), after
    `lora_shrink_pdl_kernel`: the PDL wait (or stream order) is the hand-off. Column tiles of all
    adapted slices are numbered consecutively (slice 0: [0, ch1), slice 1: [ch1, ch2), slice 2:
    [ch2, n_chunks)), so no program is idle by construction."""
    e = tl.program_id(0)
    tile = e // n_chunks
    i, chunk = _chunk_slice(e % n_chunks, ch1, ch2)
    seg = tile >> row_shift
    seg_lo = tl.load(seg_offsets_ptr + seg)
    seg_hi = tl.load(seg_offsets_ptr + seg + 1)
    slot = _slot_or_segment(seg_slots_ptr, seg, SEG_TABLES)
    b_ptr, rank = _slice_entry(w_base, b_tab, rank_tab, n_slots, slot, i, W_ALIGN)
    scale = tl.load(scale_tab + i * n_slots + slot)
    m0 = seg_lo + (tile & ((1 << row_shift) - 1)) * BLOCK_M
    offs_m = m0 + tl.arange(0, BLOCK_M)
    m_mask = offs_m < seg_hi
    rows = tl.load(row_perm_ptr + offs_m, mask=m_mask, other=0)
    col_lo, col_hi = _slice_columns(i, col0, col1, col2, col3, COLS_ALIGNED)
    width = col_hi - col_lo
    n_lo = chunk * BLOCK_N
    offs_r = tl.arange(0, BLOCK_R)
    r_mask = offs_r < rank
    # B does not depend on the shrink: its tile is in flight while the shrink programs run.
    offs_n = n_lo + tl.arange(0, BLOCK_N)
    n_mask = offs_n < width
    bt = tl.load(b_ptr + offs_n[None, :] * rank + offs_r[:, None], mask=r_mask[:, None] & n_mask[None, :],
                 other=0.0)  # fmt: skip
    if USE_PDL:
        tl.extra.cuda.gdc_wait()  # y and h belong to the kernel before until it is done
    y_rows = y_ptr + rows[:, None] * stride_ym + col_lo
    y_mask = m_mask[:, None] & n_mask[None, :]
    if USE_PDL:
        tl.extra.cuda.gdc_launch_dependents()  # only the h sum, dot and add are left: the next call may start
    h = _sum_partials(
        h_ptr, i, num_rows, n_split, offs_m, m_mask, offs_r, N_SLICES, N_SPLIT, BLOCK_M, BLOCK_R, True
    )
    if (m0 < seg_hi) & (rank > 0):
        hs = (tl.where(r_mask[None, :], h, 0.0) * scale).to(y_ptr.dtype.element_ty)
        _add_y(y_rows + offs_n[None, :], _dot(hs, bt, None), y_mask)


@triton.jit(
    do_not_specialize=_RUNTIME,
    do_not_specialize_on_alignment=["seg_slots_ptr", "b_tab", "rank_tab", "scale_tab"],
)
def lora_expand_rows_kernel(
    y_ptr, w_base, h_ptr, row_perm_ptr, row_seg_ptr, seg_slots_ptr, b_tab, rank_tab, scale_tab, n_slots,
    stride_ym, num_rows, n_segs, col0, col1, col2, col3, ch1, ch2, n_chunks, n_split,
    N_SLICES: tl.constexpr, W_ALIGN: tl.constexpr, COLS_ALIGNED: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr, N_SPLIT: tl.constexpr,
    USE_PDL: tl.constexpr, SEG_TABLES: tl.constexpr, FOR_LOOP: tl.constexpr, TABLE_ASM: tl.constexpr,
):  # fmt: skip
    """Expand over row tiles that span segments (grid: row tiles x column chunks of all adapted
    slices), after `lora_shrink_pdl_kernel`: a program takes BLOCK_M consecutive rows of the
    segment order, whichever segments they belong to, and loops over those segments, adding each
    one's H B^T into the rows that are its own. Decode segments of one or two rows then fill the
    row tile instead of 2 of its 16 rows, so a wide group (gate_up) needs a fraction of the
    programs. row_seg: [num_rows] int32, the segment of every row (n_segs past the last
    segment's rows).

    The first segment's B tile is loaded before the PDL wait (it does not depend on the shrink);
    the loop starts at the second. The loop is counted (FOR_LOOP, CUDA), so the compiler
    pipelines it. Each B tile's address hangs on table loads (the segment's entry), and a
    pipelined table load is staged through shared memory behind a wait for every copy in flight,
    which drains the B tiles issued ahead: in effect one B tile at a time. TABLE_ASM (CUDA only)
    reads the entries by `_ld_opaque`, which the pipeliner leaves alone, so it stages B alone,
    num_stages - 1 tiles ahead."""
    pid = tl.program_id(0)
    tile = pid // n_chunks
    i, chunk = _chunk_slice(pid % n_chunks, ch1, ch2)
    m0 = tile * BLOCK_M
    offs_m = m0 + tl.arange(0, BLOCK_M)
    row_seg = tl.load(row_seg_ptr + offs_m, mask=offs_m < num_rows, other=n_segs)
    m_mask = row_seg < n_segs
    rows = tl.load(row_perm_ptr + offs_m, mask=m_mask, other=0)
    # row_seg never decreases: the tile's segments are those of its first and last live rows and
    # all between. The bound is the last live row's, not the tile's last row's: in a captured step
    # rows past the live ones carry n_segs, and the loop must not walk the empty padding segments
    # (s_lo = n_segs, s_hi = -1: no row of the tile is in a segment, and the loop is empty).
    s_lo = tl.load(row_seg_ptr + m0)
    s_hi = tl.max(tl.where(m_mask, row_seg, -1), axis=0)
    col_lo, col_hi = _slice_columns(i, col0, col1, col2, col3, COLS_ALIGNED)
    offs_n = chunk * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < col_hi - col_lo
    offs_r = tl.arange(0, BLOCK_R)
    # a segment index inside the tables when the tile has no live row, and nothing read; plain
    # loads, since there is no loop here for the pipeliner to stage them in
    bt0, scale0, r_mask0 = _rows_segment_b(
        tl.minimum(s_lo, n_segs - 1), s_lo <= s_hi, offs_n, n_mask, offs_r, w_base, b_tab, rank_tab,
        scale_tab, seg_slots_ptr, n_slots, i, W_ALIGN, SEG_TABLES, False,
    )  # fmt: skip
    if USE_PDL:
        tl.extra.cuda.gdc_wait()  # y and h belong to the shrink launch until it is done
        tl.extra.cuda.gdc_launch_dependents()
    h = _sum_partials(
        h_ptr, i, num_rows, n_split, offs_m, m_mask, offs_r, N_SLICES, N_SPLIT, BLOCK_M, BLOCK_R, True
    )
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc = _rows_segment_dot(acc, h, s_lo, row_seg, bt0, scale0, r_mask0, y_ptr.dtype.element_ty)
    s_first = s_lo + 1
    if FOR_LOOP:
        # empty when no row of the tile is in a segment
        for seg in range(s_first, s_hi + 1):
            # the pipeliner also runs the table loads for up to num_stages - 1 iterations past the
            # end (unpredicated, with TABLE_ASM): an index inside the tables keeps them in bounds
            bt, scale, r_mask = _rows_segment_b(
                tl.minimum(seg, n_segs - 1), True, offs_n, n_mask, offs_r, w_base, b_tab, rank_tab, scale_tab,
                seg_slots_ptr, n_slots, i, W_ALIGN, SEG_TABLES, TABLE_ASM,
            )  # fmt: skip
            acc = _rows_segment_dot(acc, h, seg, row_seg, bt, scale, r_mask, y_ptr.dtype.element_ty)
    else:
        # the interpreter cannot take loaded values as range bounds; the same body in a while loop
        seg = s_first
        while seg <= s_hi:
            bt, scale, r_mask = _rows_segment_b(
                seg, True, offs_n, n_mask, offs_r, w_base, b_tab, rank_tab, scale_tab, seg_slots_ptr, n_slots,
                i, W_ALIGN, SEG_TABLES, False,
            )  # fmt: skip
            acc = _rows_segment_dot(acc, h, seg, row_seg, bt, scale, r_mask, y_ptr.dtype.element_ty)
            seg += 1
    # Y after the loop: loaded before it, its tile and 64-bit addresses held across the loop
    # double the registers per thread (compiled for sm_90: 80 -> 168 with 128-column tiles)
    y_ptrs = y_ptr + rows[:, None] * stride_ym + col_lo + offs_n[None, :]
    _add_y(y_ptrs, acc, m_mask[:, None] & n_mask[None, :])


@triton.jit
def _rows_segment_b(
    seg, live, offs_n, n_mask, offs_r, w_base, b_tab, rank_tab, scale_tab, seg_slots_ptr, n_slots, i,
    W_ALIGN: tl.constexpr, SEG_TABLES: tl.constexpr, TABLE_ASM: tl.constexpr,
):  # fmt: skip
    """One segment's B tile [BLOCK_R, BLOCK_N] of slice i, its scale and its rank's mask (the
    tile is all masked off, and reads nothing, when live is false). TABLE_ASM: the table entries
    by `_ld_opaque`."""
    if TABLE_ASM:
        slot = seg if SEG_TABLES else _ld_opaque(seg_slots_ptr + seg, True)
        # the values are multiples already; written as such, since the compiler's alignment
        # analysis takes no hint on an inline-assembly result
        off = _ld_opaque(b_tab + i * n_slots + slot, True) // W_ALIGN * W_ALIGN
        rank = _ld_opaque(rank_tab + i * n_slots + slot, True)
        rank = rank // 8 * 8
        b_ptr = w_base + off
    else:
        slot = _slot_or_segment(seg_slots_ptr, seg, SEG_TABLES)
        b_ptr, rank = _slice_entry(w_base, b_tab, rank_tab, n_slots, slot, i, W_ALIGN)
    scale = _ld_opaque(scale_tab + i * n_slots + slot, TABLE_ASM)
    r_mask = offs_r < tl.where(live, rank, 0)
    bt = tl.load(b_ptr + offs_n[None, :] * rank + offs_r[:, None], mask=r_mask[:, None] & n_mask[None, :],
                 other=0.0)  # fmt: skip
    return bt, scale, r_mask


@triton.jit
def _rows_segment_dot(acc, h, seg, row_seg, bt, scale, r_mask, OUT_DTYPE: tl.constexpr):
    """One segment's share of a row-loop expand tile: acc += (its rows of s * H) B^T."""
    # only this segment's rows, only its rank's columns (the shrink may not have written past it)
    own = (row_seg == seg)[:, None] & r_mask[None, :]
    hs = (tl.where(own, h, 0.0) * scale).to(OUT_DTYPE)
    return _dot(hs, bt, acc)
