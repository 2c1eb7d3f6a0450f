"""The `@triton.jit` helpers the LoRA kernels share (`triton_kernels`, `triton_split`): weight-table
entries, the shrink's row tile, the expand's sum of K-split partials, Y's atomic add.

Specializations: every shape a server can meet must compile into a small, fixed set of variants
warmed at startup (`lora/warmup.py`), so the values that change from step to step are runtime
arguments here, and a constexpr is kept only where it sets a tile or unroll that matters for speed:

- ranks: every table rank is a multiple of 8 (`triton_table` stores odd-rank adapters zero-padded
  to the next multiple of 8, which leaves every product unchanged), so B's rows are 16-byte
  aligned for every adapter and no aligned/unaligned pair of variants exists;
- which slices the step's adapters adapt: a runtime mask that zeroes the other slices' ranks (their
  loads are masked off and move no bytes), not a constexpr per subset of slices;
- the shrink's K chunk: a runtime loop bound (`k_chunk`, a multiple of BLOCK_K that the launch's
  integer specialization keeps "divisible by 16", so X and A loads stay 16-byte vectors);
- the K split: runtime `n_split`; the expand sums the partials in one unrolled burst of N_SPLIT
  (a bucketed upper bound, `triton_config.split_cap`) predicated loads, those past n_split masked off.

Imported only by the kernel modules, so `import loraplex.lora` works without triton.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _slice_entry(w_base, off_tab, rank_tab, n_slots, slot, i, W_ALIGN: tl.constexpr):
    """(pointer to this slot's weight for slice i, its rank); rank 0 when the slot skips the slice.

    The table holds element offsets from w_base rather than raw addresses: a pointer built by
    adding a 16-byte multiple to an aligned kernel argument keeps its alignment for the compiler,
    so weight loads vectorize (an integer cast to a pointer would not). Ranks are multiples of 8
    (`triton_table` pads the others), which makes B's rows 16-byte aligned too.
    """
    off = tl.multiple_of(tl.load(off_tab + i * n_slots + slot), W_ALIGN)
    rank = tl.multiple_of(tl.load(rank_tab + i * n_slots + slot), 8)
    return w_base + off, rank


@triton.jit
def _slice_entries(
    w_base, tab, rank_tab, n_slots, slot, slice_mask, N_SLICES: tl.constexpr, W_ALIGN: tl.constexpr
):
    """(pointer, rank) of slices 0, 1, 2 for this slot (slices past N_SLICES repeat slice 0, and
    are never read), ranks zeroed for the slices outside the runtime `slice_mask` (no adapter of
    the step adapts them: their loads are masked off), and the largest rank left."""
    p0, r0 = _slice_entry(w_base, tab, rank_tab, n_slots, slot, 0, W_ALIGN)
    r0 = tl.where((slice_mask & 1) != 0, r0, 0)
    r_max = r0
    p1, r1 = p0, r0
    p2, r2 = p0, r0
    if N_SLICES > 1:
        p1, r1 = _slice_entry(w_base, tab, rank_tab, n_slots, slot, 1, W_ALIGN)
        r1 = tl.where((slice_mask & 2) != 0, r1, 0)
        r_max = tl.maximum(r_max, r1)
    if N_SLICES > 2:
        p2, r2 = _slice_entry(w_base, tab, rank_tab, n_slots, slot, 2, W_ALIGN)
        r2 = tl.where((slice_mask & 4) != 0, r2, 0)
        r_max = tl.maximum(r_max, r2)
    return p0, r0, p1, r1, p2, r2, r_max


@triton.jit
def _dot(a, b, acc):
    # float32 operands get IEEE products, as the model's own float32 GEMMs do: Triton's default for
    # them is TF32 (10-bit mantissas). A static branch: 16-bit operands compile the plain dot.
    if a.dtype == tl.float32:
        return tl.dot(a, b, acc, input_precision="ieee")
    else:
        return tl.dot(a, b, acc)


@triton.jit
def _shrink_acc(acc, xt, a_ptr, rank, d_in, offs_r, offs_k, k_mask):
    # a: [r, d_in] row-major; the tile is [BLOCK_R, BLOCK_K], rows past the rank masked (no bytes)
    at = tl.load(
        a_ptr + offs_r[:, None] * d_in + offs_k[None, :],
        mask=(offs_r[:, None] < rank) & k_mask[None, :],
        other=0.0,
    )
    return _dot(xt, tl.trans(at), acc)


@triton.jit
def _shrink_store(h_ptr, acc, block, num_rows, offs_m, m_mask, offs_r, BLOCK_R: tl.constexpr):
    # block = split * N_SLICES + slice: which [R, BLOCK_R] plane of h this partial goes to
    base = h_ptr + (block * num_rows).to(tl.int64) * BLOCK_R
    tl.store(base + offs_m[:, None] * BLOCK_R + offs_r[None, :], acc, mask=m_mask[:, None])


@triton.jit
def _shrink_k_step(
    acc0, acc1, acc2, x_rows, kk, m_mask, a0, r0, a1, r1, a2, r2, d_in, offs_r,
    N_SLICES: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    offs_k = kk + tl.arange(0, BLOCK_K)
    k_mask = offs_k < d_in  # chunks never overlap (the loop stays inside its chunk)
    # one X tile feeds every slice: X is read once per group, not once per slice
    xt = tl.load(x_rows + offs_k[None, :], mask=m_mask[:, None] & k_mask[None, :], other=0.0)
    acc0 = _shrink_acc(acc0, xt, a0, r0, d_in, offs_r, offs_k, k_mask)
    if N_SLICES > 1:
        acc1 = _shrink_acc(acc1, xt, a1, r1, d_in, offs_r, offs_k, k_mask)
    if N_SLICES > 2:
        acc2 = _shrink_acc(acc2, xt, a2, r2, d_in, offs_r, offs_k, k_mask)
    return acc0, acc1, acc2


@triton.jit
def _shrink_tile(
    x_ptr, h_ptr, rows, offs_m, m_mask, offs_r, split, k_chunk, a0, r0, a1, r1, a2, r2, d_in, stride_xm,
    num_rows, N_SLICES: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr,
    BLOCK_RC: tl.constexpr, FOR_LOOP: tl.constexpr,
):  # fmt: skip
    """One row tile's partial H over one K chunk, for one chunk of rank columns and every slice."""
    acc0 = tl.zeros((BLOCK_M, BLOCK_RC), dtype=tl.float32)
    acc1 = tl.zeros((BLOCK_M, BLOCK_RC), dtype=tl.float32)
    acc2 = tl.zeros((BLOCK_M, BLOCK_RC), dtype=tl.float32)
    x_rows = x_ptr + rows[:, None] * stride_xm
    # k_chunk is a multiple of BLOCK_K: said so, the X and A tiles stay 16-byte vector loads
    k_lo = tl.multiple_of(split * k_chunk, BLOCK_K)
    if FOR_LOOP:  # CUDA: a counted loop over runtime bounds, which the compiler pipelines
        for kk in range(k_lo, k_lo + k_chunk, BLOCK_K):
            acc0, acc1, acc2 = _shrink_k_step(
                acc0, acc1, acc2, x_rows, kk, m_mask, a0, r0, a1, r1, a2, r2, d_in, offs_r, N_SLICES, BLOCK_K
            )
    else:  # the interpreter (numpy >= 2.4 refuses a runtime value as a `range` bound): same steps
        kk = k_lo
        while kk < k_lo + k_chunk:
            acc0, acc1, acc2 = _shrink_k_step(
                acc0, acc1, acc2, x_rows, kk, m_mask, a0, r0, a1, r1, a2, r2, d_in, offs_r, N_SLICES, BLOCK_K
            )
            kk += BLOCK_K
    # Every (split, slice) row block the expand kernel will read is written here, zeros included.
    _shrink_store(h_ptr, acc0, split * N_SLICES, num_rows, offs_m, m_mask, offs_r, BLOCK_R)
    if N_SLICES > 1:
        _shrink_store(h_ptr, acc1, split * N_SLICES + 1, num_rows, offs_m, m_mask, offs_r, BLOCK_R)
    if N_SLICES > 2:
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
    h_ptr, i, num_rows, n_split, offs_m, m_mask, offs_r, N_SLICES: tl.constexpr, N_SPLIT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, L2_ONLY: tl.constexpr,
):  # fmt: skip
    """h of slice i for rows offs_m: the sum of the shrink's partials over its n_split K splits,
    loaded in one unrolled burst of N_SPLIT (>= n_split) loads, those past n_split predicated off
    (no bytes; a few instructions each), in split order as before (L2_ONLY: `.cg`, past L1: the
    split launch's expands read h that a launch they overlapped under PDL has just written)."""
    h = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    for s in tl.static_range(N_SPLIT):
        base = h_ptr + ((s * N_SLICES + i) * num_rows).to(tl.int64) * BLOCK_R
        mask = m_mask[:, None] & (s < n_split)
        if L2_ONLY:
            h += tl.load(base + offs_m[:, None] * BLOCK_R + offs_r[None, :], mask=mask, other=0.0,
                         cache_modifier=".cg")  # fmt: skip
        else:
            h += tl.load(base + offs_m[:, None] * BLOCK_R + offs_r[None, :], mask=mask, other=0.0)
    return h


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


__all__ = ["triton"]
