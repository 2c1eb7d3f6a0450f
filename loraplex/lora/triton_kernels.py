"""Triton kernels of the segmented LoRA op: shrink (H = X_a A_a^T) and expand (Y += s_a H B_a^T),
each its own launch: the two-launch pair (`lora_shrink_kernel`, `lora_expand_kernel`; prefill, and
the decode calls the split launch does not take) and the split launch of decode steps
(`lora_shrink_pdl_kernel`, then `lora_expand_pdl_kernel` or `lora_expand_rows_kernel`, chained by
programmatic dependent launch on CUDA).

Imported only by `ops_triton` (lazily), so `import loraplex.lora` works without triton.

Weights are rank-exact: every (slice, slot) entry of the pointer tables points at that adapter's
own A [r, d_in] and B [d_out, r] (row-major, 16-byte aligned; see `triton_table`), and the rank
table says how many rows of A / columns of B exist. BLOCK_R is only the register tile: loads past
an adapter's rank are masked off, so they move no bytes.

Every kernel takes the group's slices (q/k/v or gate/up) in one launch. SLICE_MASK (constexpr)
drops slices that no adapter of the step targets at compile time, so they cost nothing.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _slice_entry(
    w_base, off_tab, rank_tab, n_slots, slot, i, RANK_ALIGNED: tl.constexpr, W_ALIGN: tl.constexpr
):
    """(pointer to this slot's weight for slice i, its rank); rank 0 when the slot skips the slice.

    The table holds element offsets from w_base rather than raw addresses: a pointer built by
    adding a 16-byte multiple to an aligned kernel argument keeps its alignment for the compiler,
    so weight loads vectorize (an integer cast to a pointer would not).
    """
    off = tl.multiple_of(tl.load(off_tab + i * n_slots + slot), W_ALIGN)
    rank = tl.load(rank_tab + i * n_slots + slot)
    if RANK_ALIGNED:
        rank = tl.multiple_of(rank, 8)
    return w_base + off, rank


@triton.jit
def _shrink_acc(acc, xt, a_ptr, rank, d_in, offs_r, offs_k, k_mask):
    # a: [r, d_in] row-major; the tile is [BLOCK_R, BLOCK_K], rows past the rank masked (no bytes)
    at = tl.load(
        a_ptr + offs_r[:, None] * d_in + offs_k[None, :],
        mask=(offs_r[:, None] < rank) & k_mask[None, :],
        other=0.0,
    )
    return tl.dot(xt, tl.trans(at), acc)


@triton.jit
def _shrink_store(h_ptr, acc, block, num_rows, offs_m, m_mask, offs_r, BLOCK_R: tl.constexpr):
    # block = split * N_SLICES + slice: which [R, BLOCK_R] plane of h this partial goes to
    base = h_ptr + (block * num_rows).to(tl.int64) * BLOCK_R
    tl.store(base + offs_m[:, None] * BLOCK_R + offs_r[None, :], acc, mask=m_mask[:, None])


@triton.jit
def _slice_entries(
    w_base, tab, rank_tab, n_slots, slot, N_SLICES: tl.constexpr, SLICE_MASK: tl.constexpr,
    RANK_ALIGNED: tl.constexpr, W_ALIGN: tl.constexpr,
):  # fmt: skip
    """(pointer, rank) of slices 0, 1, 2 for this slot (slices past N_SLICES repeat slice 0, and
    are never read) and the largest rank over the slices SLICE_MASK keeps."""
    p0, r0 = _slice_entry(w_base, tab, rank_tab, n_slots, slot, 0, RANK_ALIGNED, W_ALIGN)
    r_max = r0 if SLICE_MASK & 1 else 0
    p1, r1 = p0, r0
    p2, r2 = p0, r0
    if N_SLICES > 1:
        p1, r1 = _slice_entry(w_base, tab, rank_tab, n_slots, slot, 1, RANK_ALIGNED, W_ALIGN)
        if SLICE_MASK & 2:
            r_max = tl.maximum(r_max, r1)
    if N_SLICES > 2:
        p2, r2 = _slice_entry(w_base, tab, rank_tab, n_slots, slot, 2, RANK_ALIGNED, W_ALIGN)
        if SLICE_MASK & 4:
            r_max = tl.maximum(r_max, r2)
    return p0, r0, p1, r1, p2, r2, r_max


@triton.jit
def _shrink_tile(
    x_ptr, h_ptr, rows, offs_m, m_mask, offs_r, split, a0, r0, a1, r1, a2, r2, d_in, stride_xm, num_rows,
    N_SLICES: tl.constexpr, SLICE_MASK: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_RC: tl.constexpr, K_CHUNK: tl.constexpr,
):  # fmt: skip
    """One row tile's partial H over one K chunk, for one chunk of rank columns and every slice."""
    acc0 = tl.zeros((BLOCK_M, BLOCK_RC), dtype=tl.float32)
    acc1 = tl.zeros((BLOCK_M, BLOCK_RC), dtype=tl.float32)
    acc2 = tl.zeros((BLOCK_M, BLOCK_RC), dtype=tl.float32)
    x_rows = x_ptr + rows[:, None] * stride_xm
    k_lo = split * K_CHUNK
    # Compile-time trip counts: the compiler can pipeline fully (and the interpreter needs them).
    for kk in range(0, K_CHUNK, BLOCK_K):
        offs_k = k_lo + kk + tl.arange(0, BLOCK_K)
        k_mask = offs_k < d_in  # chunks never overlap (the loop stays inside K_CHUNK)
        # one X tile feeds every slice: X is read once per group, not once per slice
        xt = tl.load(x_rows + offs_k[None, :], mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        if SLICE_MASK & 1:
            acc0 = _shrink_acc(acc0, xt, a0, r0, d_in, offs_r, offs_k, k_mask)
        if N_SLICES > 1 and SLICE_MASK & 2:
            acc1 = _shrink_acc(acc1, xt, a1, r1, d_in, offs_r, offs_k, k_mask)
        if N_SLICES > 2 and SLICE_MASK & 4:
            acc2 = _shrink_acc(acc2, xt, a2, r2, d_in, offs_r, offs_k, k_mask)
    # Every (split, slice) row block the expand kernel will read is written here, zeros included.
    if SLICE_MASK & 1:
        _shrink_store(h_ptr, acc0, split * N_SLICES, num_rows, offs_m, m_mask, offs_r, BLOCK_R)
    if N_SLICES > 1 and SLICE_MASK & 2:
        _shrink_store(h_ptr, acc1, split * N_SLICES + 1, num_rows, offs_m, m_mask, offs_r, BLOCK_R)
    if N_SLICES > 2 and SLICE_MASK & 4:
        _shrink_store(h_ptr, acc2, split * N_SLICES + 2, num_rows, offs_m, m_mask, offs_r, BLOCK_R)


@triton.jit
def _chunk_slice(c, ch1, ch2):
    """(slice, chunk within it) of column chunk c, when the chunks of all adapted slices are
    numbered consecutively (slice 0: [0, ch1), slice 1: [ch1, ch2), slice 2: [ch2, ...))."""
    i = (c >= ch1).to(tl.int32) + (c >= ch2).to(tl.int32)
    return i, c - tl.where(i == 0, 0, tl.where(i == 1, ch1, ch2))


@triton.jit
def _slice_columns(i, col0, col1, col2, col3, COLS_ALIGNED: tl.constexpr):
    """Output columns [col_lo, col_hi) of slice i (slice i occupies [col_i, col_{i+1}))."""
    col_lo = tl.where(i == 0, col0, tl.where(i == 1, col1, col2))
    col_hi = tl.where(i == 0, col1, tl.where(i == 1, col2, col3))
    if COLS_ALIGNED:
        col_lo = tl.multiple_of(col_lo, 8)
        col_hi = tl.multiple_of(col_hi, 8)
    return col_lo, col_hi


@triton.jit
def _sum_partials(
    h_ptr, i, num_rows, offs_m, m_mask, offs_r, N_SLICES: tl.constexpr, N_SPLIT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, L2_ONLY: tl.constexpr,
):  # fmt: skip
    """h of slice i for rows offs_m: the sum of the shrink's partials over its K splits, loaded
    in one unrolled burst (L2_ONLY: `.cg`, past L1: the split launch's expands read h that a launch
    they overlapped under PDL has just written)."""
    h = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    for s in tl.static_range(N_SPLIT):
        base = h_ptr + ((s * N_SLICES + i) * num_rows).to(tl.int64) * BLOCK_R
        if L2_ONLY:
            h += tl.load(base + offs_m[:, None] * BLOCK_R + offs_r[None, :], mask=m_mask[:, None], other=0.0,
                         cache_modifier=".cg")  # fmt: skip
        else:
            h += tl.load(base + offs_m[:, None] * BLOCK_R + offs_r[None, :], mask=m_mask[:, None], other=0.0)
    return h


@triton.jit
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
    N_SLICES: tl.constexpr,
    SLICE_MASK: tl.constexpr,
    RANK_ALIGNED: tl.constexpr,
    W_ALIGN: tl.constexpr,  # elements per 16 bytes
    BLOCK_M: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_R: tl.constexpr,  # width of h's rank planes (covers the step's largest rank)
    BLOCK_RC: tl.constexpr,  # rank columns per program
    K_CHUNK: tl.constexpr,  # K columns per split, a multiple of BLOCK_K
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
        w_base, a_tab, rank_tab, n_slots, slot, N_SLICES, SLICE_MASK, RANK_ALIGNED, W_ALIGN
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
        x_ptr, h_ptr, rows, offs_m, m_mask, offs_r, split, a0, r0, a1, r1, a2, r2, d_in, stride_xm, num_rows,
        N_SLICES, SLICE_MASK, BLOCK_M, BLOCK_K, BLOCK_R, BLOCK_RC, K_CHUNK,
    )  # fmt: skip


@triton.jit
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
    N_SLICES: tl.constexpr,
    SLICE_MASK: tl.constexpr,
    RANK_ALIGNED: tl.constexpr,
    W_ALIGN: tl.constexpr,
    COLS_ALIGNED: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_R: tl.constexpr,
    N_SPLIT: tl.constexpr,  # K chunks the shrink wrote partials for
    N_CHUNK: tl.constexpr,  # output columns per program, a multiple of BLOCK_N
):
    # grid: (S * row_tiles, column chunks of the widest slice, N_SLICES)
    pid = tl.program_id(0)
    chunk = tl.program_id(1)
    i = tl.program_id(2)
    if ((SLICE_MASK >> i) & 1) == 0:
        return
    seg = pid // row_tiles
    seg_lo = tl.load(seg_offsets_ptr + seg)  # as in the shrink: independent loads first
    seg_hi = tl.load(seg_offsets_ptr + seg + 1)
    slot = tl.load(seg_slots_ptr + seg)
    b_ptr, rank = _slice_entry(w_base, b_tab, rank_tab, n_slots, slot, i, RANK_ALIGNED, W_ALIGN)
    scale = tl.load(scale_tab + i * n_slots + slot)
    m0 = seg_lo + (pid % row_tiles) * BLOCK_M
    offs_m = m0 + tl.arange(0, BLOCK_M)
    m_mask = offs_m < seg_hi
    rows = tl.load(row_perm_ptr + offs_m, mask=m_mask, other=0)
    offs_r = tl.arange(0, BLOCK_R)
    # h: no wait on the rank (columns past it, which the shrink may not have written, are zeroed
    # after the load)
    h = _sum_partials(h_ptr, i, num_rows, offs_m, m_mask, offs_r, N_SLICES, N_SPLIT, BLOCK_M, BLOCK_R, False)
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
        delta = tl.dot(h, bt)  # [BLOCK_M, BLOCK_N] float32
        tl.store(y_rows + offs_n[None, :], (yt.to(tl.float32) + delta).to(yt.dtype), mask=y_mask)


# --- the split launch (decode): shrink and expand as two launches chained by PDL ------------------


@triton.jit
def _add_y(ptrs, delta, mask):
    """Y += delta (float32) on a tile: delta rounded to Y's dtype and added by one atomic add per
    element, so the expand never reads Y (no round trip after the PDL wait, no bytes). Every
    element of Y has one writer in a launch, so the result does not depend on timing; it rounds
    twice, as adding a LoRA output in Y's dtype (PEFT's order) does."""
    tl.atomic_add(ptrs, delta.to(ptrs.dtype.element_ty), mask=mask, sem="relaxed")


@triton.jit
def _slot_or_segment(seg_slots_ptr, seg, SEG_TABLES: tl.constexpr):
    """The column of the weight tables this segment reads: its slot, or with per-step segment
    tables (gathered once per step by `begin_step`, one column per segment) the segment itself,
    which saves the dependent load of the slot before the table loads."""
    if SEG_TABLES:
        return seg
    else:
        return tl.load(seg_slots_ptr + seg)


# The decode kernels below take the values that differ between the decode graphs captured at
# startup (segment capacity, bucket rows, table pointers that are views at per-step offsets) as
# plain runtime values: specializing on them (== 1, divisible by 16, 16-byte aligned) compiled
# 2.2x as many variants for the same graph keys (268 against 120 on the 8B shapes, max batch 64).
@triton.jit(
    do_not_specialize=["n_slots", "num_rows"],
    do_not_specialize_on_alignment=["seg_slots_ptr", "a_tab", "rank_tab"],
)
def lora_shrink_pdl_kernel(
    x_ptr, w_base, h_ptr, row_perm_ptr, seg_offsets_ptr, seg_slots_ptr, a_tab, rank_tab, n_slots, d_in,
    stride_xm, num_rows, row_tiles,
    N_SLICES: tl.constexpr, SLICE_MASK: tl.constexpr, RANK_ALIGNED: tl.constexpr, W_ALIGN: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_RC: tl.constexpr,
    K_CHUNK: tl.constexpr, N_SPLIT: tl.constexpr, USE_PDL: tl.constexpr, SEG_TABLES: tl.constexpr,
):  # fmt: skip
    """The split launch's shrink (grid: row tiles x K chunks x rank chunks, planned to fill the
    GPU by `triton_config.plan_split`), handing h to `lora_expand_pdl_kernel` (or
    `lora_expand_rows_kernel`) through the launch boundary. With PDL the expand launch may start
    at once: its programs load their B tiles while these run."""
    if USE_PDL:
        tl.extra.cuda.gdc_launch_dependents()
    pid = tl.program_id(0)
    # pid -> (row tile, K split, rank chunk), rank chunk fastest: programs sharing an X tile adjacent
    R_CHUNKS: tl.constexpr = BLOCK_R // BLOCK_RC
    rc = pid % R_CHUNKS
    split = (pid // R_CHUNKS) % N_SPLIT
    tile = pid // (R_CHUNKS * N_SPLIT)
    seg = tile // row_tiles
    seg_lo = tl.load(seg_offsets_ptr + seg)
    seg_hi = tl.load(seg_offsets_ptr + seg + 1)
    slot = _slot_or_segment(seg_slots_ptr, seg, SEG_TABLES)
    a0, r0, a1, r1, a2, r2, r_max = _slice_entries(
        w_base, a_tab, rank_tab, n_slots, slot, N_SLICES, SLICE_MASK, RANK_ALIGNED, W_ALIGN
    )
    m0 = seg_lo + (tile % row_tiles) * BLOCK_M
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
            x_ptr, h_ptr, rows, offs_m, m_mask, offs_r, split, a0, r0, a1, r1, a2, r2, d_in, stride_xm,
            num_rows, N_SLICES, SLICE_MASK, BLOCK_M, BLOCK_K, BLOCK_R, BLOCK_RC, K_CHUNK,
        )  # fmt: skip


@triton.jit(
    do_not_specialize=["n_slots", "num_rows", "ch1", "ch2", "n_chunks"],
    do_not_specialize_on_alignment=["seg_slots_ptr", "b_tab", "rank_tab", "scale_tab"],
)
def lora_expand_pdl_kernel(
    y_ptr, w_base, h_ptr, row_perm_ptr, seg_offsets_ptr, seg_slots_ptr, b_tab, rank_tab, scale_tab, n_slots,
    stride_ym, num_rows, row_tiles, col0, col1, col2, col3, ch1, ch2, n_chunks,
    N_SLICES: tl.constexpr, RANK_ALIGNED: tl.constexpr, W_ALIGN: tl.constexpr, COLS_ALIGNED: tl.constexpr,
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
    seg = tile // row_tiles
    seg_lo = tl.load(seg_offsets_ptr + seg)
    seg_hi = tl.load(seg_offsets_ptr + seg + 1)
    slot = _slot_or_segment(seg_slots_ptr, seg, SEG_TABLES)
    b_ptr, rank = _slice_entry(w_base, b_tab, rank_tab, n_slots, slot, i, RANK_ALIGNED, W_ALIGN)
    scale = tl.load(scale_tab + i * n_slots + slot)
    m0 = seg_lo + (tile % row_tiles) * BLOCK_M
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
    h = _sum_partials(h_ptr, i, num_rows, offs_m, m_mask, offs_r, N_SLICES, N_SPLIT, BLOCK_M, BLOCK_R, True)
    if (m0 < seg_hi) & (rank > 0):
        hs = (tl.where(r_mask[None, :], h, 0.0) * scale).to(y_ptr.dtype.element_ty)
        _add_y(y_rows + offs_n[None, :], tl.dot(hs, bt), y_mask)


@triton.jit(
    do_not_specialize=["n_slots", "num_rows", "n_segs"],
    do_not_specialize_on_alignment=["seg_slots_ptr", "b_tab", "rank_tab", "scale_tab"],
)
def lora_expand_rows_kernel(
    y_ptr, w_base, h_ptr, row_perm_ptr, row_seg_ptr, seg_slots_ptr, b_tab, rank_tab, scale_tab, n_slots,
    stride_ym, num_rows, n_segs, col0, col1, col2, col3, ch1, ch2, n_chunks,
    N_SLICES: tl.constexpr, RANK_ALIGNED: tl.constexpr, W_ALIGN: tl.constexpr, COLS_ALIGNED: tl.constexpr,
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
        scale_tab, seg_slots_ptr, n_slots, i, RANK_ALIGNED, W_ALIGN, SEG_TABLES, False,
    )  # fmt: skip
    if USE_PDL:
        tl.extra.cuda.gdc_wait()  # y and h belong to the shrink launch until it is done
        tl.extra.cuda.gdc_launch_dependents()
    h = _sum_partials(h_ptr, i, num_rows, offs_m, m_mask, offs_r, N_SLICES, N_SPLIT, BLOCK_M, BLOCK_R, True)
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
                seg_slots_ptr, n_slots, i, RANK_ALIGNED, W_ALIGN, SEG_TABLES, TABLE_ASM,
            )  # fmt: skip
            acc = _rows_segment_dot(acc, h, seg, row_seg, bt, scale, r_mask, y_ptr.dtype.element_ty)
    else:
        # the interpreter cannot take loaded values as range bounds; the same body in a while loop
        seg = s_first
        while seg <= s_hi:
            bt, scale, r_mask = _rows_segment_b(
                seg, True, offs_n, n_mask, offs_r, w_base, b_tab, rank_tab, scale_tab, seg_slots_ptr, n_slots,
                i, RANK_ALIGNED, W_ALIGN, SEG_TABLES, False,
            )  # fmt: skip
            acc = _rows_segment_dot(acc, h, seg, row_seg, bt, scale, r_mask, y_ptr.dtype.element_ty)
            seg += 1
    # Y after the loop: loaded before it, its tile and 64-bit addresses held across the loop
    # double the registers per thread (compiled for sm_90: 80 -> 168 with 128-column tiles)
    y_ptrs = y_ptr + rows[:, None] * stride_ym + col_lo + offs_n[None, :]
    _add_y(y_ptrs, acc, m_mask[:, None] & n_mask[None, :])


@triton.jit
def _ld_opaque(ptr, ASM: tl.constexpr):
    """A scalar load; ASM: as inline assembly, which the loop pipeliner does not take for a load.
    It would stage a pipelined table entry through shared memory and wait for all copies in
    flight before the address that depends on it, draining the B tiles already in flight; an
    opaque load leaves the B load the loop's only load, which the pipeliner then issues stages
    ahead. The pipeliner runs it unpredicated for the iterations past the loop's end that its
    prologue and last stages cover, so its address must be valid there too (callers clamp the
    segment index)."""
    if ASM:
        # 64-bit entries (offsets, slots) in a 64-bit register, 32-bit ones (rank, scale) in a 32-bit one
        if ptr.dtype.element_ty.primitive_bitwidth == 64:
            return tl.inline_asm_elementwise(
                "ld.global.nc.b64 $0, [$1];", "=l,l", [ptr], dtype=ptr.dtype.element_ty, is_pure=True, pack=1
            )
        else:
            return tl.inline_asm_elementwise(
                "ld.global.nc.b32 $0, [$1];", "=r,l", [ptr], dtype=ptr.dtype.element_ty, is_pure=True, pack=1
            )
    else:
        return tl.load(ptr)


@triton.jit
def _rows_segment_b(
    seg, live, offs_n, n_mask, offs_r, w_base, b_tab, rank_tab, scale_tab, seg_slots_ptr, n_slots, i,
    RANK_ALIGNED: tl.constexpr, W_ALIGN: tl.constexpr, SEG_TABLES: tl.constexpr, TABLE_ASM: tl.constexpr,
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
        if RANK_ALIGNED:
            rank = rank // 8 * 8
        b_ptr = w_base + off
    else:
        slot = _slot_or_segment(seg_slots_ptr, seg, SEG_TABLES)
        b_ptr, rank = _slice_entry(w_base, b_tab, rank_tab, n_slots, slot, i, RANK_ALIGNED, W_ALIGN)
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
    return tl.dot(hs, bt, acc)


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
