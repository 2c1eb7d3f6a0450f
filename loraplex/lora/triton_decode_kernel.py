"""One-launch LoRA for decode steps without a shrink -> expand hand-off: every program recomputes
its segment's H = X_a A_a^T for its slice, then adds s_a H B_a^T into its own column chunk.

Why: in a decode step each segment has one or two rows, so the whole op is reading A and B once
per adapter. The two-phase kernels pay a dependency between phases (a second launch, or programs
spinning on counters until the shrink programs of their row tile arrive), and that latency, not
bandwidth, dominated. Here no program waits for another: a segment's A is read from DRAM by its
first program and from L2 by the others of the same slice (a group's A of all adapters is a few MB
to tens of MB, within the 50 MB L2 of an H100/H200), which costs L2 bandwidth, not DRAM bytes.

Used only when every segment fits in one row tile (`BLOCK_M` rows), so a program owns whole
segments' rows. Imported only by `ops_triton` (lazily).
"""

from __future__ import annotations

import triton
import triton.language as tl

from loraplex.lora.triton_kernels import _slice_entry


@triton.jit
def lora_decode_kernel(
    y_ptr,  # y: [T, d_out_total], updated in place
    x_ptr,  # x: [T, d_in]
    w_base,
    row_perm_ptr,  # [R] int64
    seg_offsets_ptr,  # [S + 1] int64
    seg_slots_ptr,  # [S] int64
    a_tab,  # [N_SLICES, n_slots] int64 element offsets from w_base
    b_tab,
    rank_tab,  # [N_SLICES, n_slots] int32
    scale_tab,  # [N_SLICES, n_slots] float32
    n_slots,
    d_in,
    stride_xm,
    stride_ym,
    col0,  # slice i occupies columns [col_i, col_{i+1}) of y
    col1,
    col2,
    col3,
    ch1,  # first column chunk of slice 1 / slice 2 (chunks of all slices numbered consecutively)
    ch2,
    N_SLICES: tl.constexpr,
    RANK_ALIGNED: tl.constexpr,
    W_ALIGN: tl.constexpr,
    COLS_ALIGNED: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_N: tl.constexpr,
    N_SUB: tl.constexpr,  # BLOCK_N-column tiles per program
    K_TILES: tl.constexpr,  # cdiv(d_in, BLOCK_K): a compile-time trip count, so the loads pipeline
):
    # grid: (S, column chunks of all slices). Program (seg, c): slice i, columns
    # [chunk * BLOCK_N * N_SUB, ...) of that slice, every row of the segment.
    seg = tl.program_id(0)
    c = tl.program_id(1)
    i = (c >= ch1).to(tl.int32) + (c >= ch2).to(tl.int32)
    chunk = c - tl.where(i == 0, 0, tl.where(i == 1, ch1, ch2))
    seg_lo = tl.load(seg_offsets_ptr + seg)
    seg_hi = tl.load(seg_offsets_ptr + seg + 1)
    slot = tl.load(seg_slots_ptr + seg)
    a_ptr, rank = _slice_entry(w_base, a_tab, rank_tab, n_slots, slot, i, RANK_ALIGNED, W_ALIGN)
    b_ptr, _ = _slice_entry(w_base, b_tab, rank_tab, n_slots, slot, i, RANK_ALIGNED, W_ALIGN)
    scale = tl.load(scale_tab + i * n_slots + slot)
    col_lo = tl.where(i == 0, col0, tl.where(i == 1, col1, col2))
    col_hi = tl.where(i == 0, col1, tl.where(i == 1, col2, col3))
    if COLS_ALIGNED:
        col_lo = tl.multiple_of(col_lo, 8)
        col_hi = tl.multiple_of(col_hi, 8)
    width = col_hi - col_lo
    n_lo = chunk * (BLOCK_N * N_SUB)
    # empty (padding) segment, a slice this adapter does not adapt, or past a narrower slice
    if (seg_lo >= seg_hi) | (rank == 0) | (n_lo >= width):
        return
    offs_m = seg_lo + tl.arange(0, BLOCK_M)
    m_mask = offs_m < seg_hi
    rows = tl.load(row_perm_ptr + offs_m, mask=m_mask, other=0)
    offs_r = tl.arange(0, BLOCK_R)
    r_mask = offs_r < rank
    x_rows = x_ptr + rows[:, None] * stride_xm

    acc = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    for kt in range(K_TILES):
        offs_k = kt * BLOCK_K + tl.arange(0, BLOCK_K)
        k_mask = offs_k < d_in
        xt = tl.load(x_rows + offs_k[None, :], mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        at = tl.load(
            a_ptr + offs_r[:, None] * d_in + offs_k[None, :],
            mask=r_mask[:, None] & k_mask[None, :],
            other=0.0,
        )
        acc = tl.dot(xt, tl.trans(at), acc)
    hs = (acc * scale).to(y_ptr.dtype.element_ty)  # scale folded in before the low-precision dot

    y_rows = y_ptr + rows[:, None] * stride_ym + col_lo
    for nn in range(N_SUB):
        offs_n = n_lo + nn * BLOCK_N + tl.arange(0, BLOCK_N)
        n_mask = offs_n < width
        y_mask = m_mask[:, None] & n_mask[None, :]
        yt = tl.load(y_rows + offs_n[None, :], mask=y_mask, other=0.0)
        # b: [d_out_i, r] row-major: the tile is one contiguous run of BLOCK_N * rank values
        bt = tl.load(b_ptr + offs_n[None, :] * rank + offs_r[:, None], mask=r_mask[:, None] & n_mask[None, :],
                     other=0.0)  # fmt: skip
        tl.store(y_rows + offs_n[None, :], (yt.to(tl.float32) + tl.dot(hs, bt)).to(yt.dtype), mask=y_mask)


def decode_grid(num_segments: int, n_chunks: int) -> tuple[int, int]:
    return (num_segments, n_chunks)


__all__ = ["decode_grid", "lora_decode_kernel", "triton"]
