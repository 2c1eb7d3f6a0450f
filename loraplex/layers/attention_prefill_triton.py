"""The paged-attention prefill kernel (sequences with >= 2 query rows): flash-attention tiles over
a sequence's query rows, causal from the cached prefix on. Its program body, `_prefill_program`, is
also the prefill half of a mixed step's single launch (`attention_mixed_triton.py`). Shares the key
walk of `attention_kernels_triton.py`; launched by `attention_triton.paged_attention_triton`.
"""

from __future__ import annotations

import triton
import triton.language as tl

from loraplex.layers.attention_kernels_triton import NEG_INIT, NO_WINDOW_C, _attend_keys


@triton.jit
def _prefill_program(
    s_id, tile, h, q_ptr, k_cache, v_cache, out_ptr, table_ptr, ctx_ptr, qstart_ptr, stride_qt,
    stride_qh, stride_ot, stride_oh, stride_cb, stride_cs, stride_ch, stride_bt, qk_scale, window,
    GROUP: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr, BS: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, PREC: tl.constexpr, FOR_LOOP: tl.constexpr, STAGES: tl.constexpr,
):  # fmt: skip
    """Query tile `tile` of sequence s_id, query head h: rows at positions ctx - q_len + r attend
    keys j <= position (and > position - window), cached prefix included; key tiles wholly past
    the tile's last row (or before its window) are never visited. Sequences of one row, and tiles
    past a sequence's rows, return at once."""
    q0 = tl.load(qstart_ptr + s_id)
    q_len = tl.load(qstart_ptr + s_id + 1) - q0
    r0 = tile * BLOCK_M
    if (q_len < 2) | (r0 >= q_len):
        return
    ctx = tl.load(ctx_ptr + s_id)
    first = ctx - q_len
    r = r0 + tl.arange(0, BLOCK_M)
    d = tl.arange(0, D_PAD)
    row_ok = r < q_len
    pos = first + r
    rows = (q0 + r).to(tl.int64)
    io_mask = row_ok[:, None] & (d[None, :] < D)
    q = tl.load(q_ptr + rows[:, None] * stride_qt + h * stride_qh + d[None, :], mask=io_mask, other=0.0)
    k_hi = tl.minimum(ctx, first + tl.minimum(q_len, r0 + BLOCK_M))
    k_lo = tl.maximum(first + r0 - window + 1, 0)
    m_i = tl.zeros([BLOCK_M], dtype=tl.float32) + NEG_INIT
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, D_PAD], dtype=tl.float32)
    table_row = table_ptr + s_id.to(tl.int64) * stride_bt
    kv_off = (h // GROUP) * stride_ch
    # Open tiles first: whole key tiles at or below the query tile's first position, which every
    # row sees (layers without a window only), need no mask; the rest (the diagonal, a window's
    # edge) take the masked path. Two loops, each software-pipelined on its own.
    k_mid = k_lo + tl.where(window >= NO_WINDOW_C, (first + r0 + 1 - k_lo) // BLOCK_N, 0) * BLOCK_N
    m_i, l_i, acc = _attend_keys(
        q, k_cache, v_cache, table_row, kv_off, pos, k_lo, k_mid, k_hi, window, m_i, l_i, acc,
        qk_scale, stride_cb, stride_cs, BS, BLOCK_N, D, D_PAD, PREC, False, FOR_LOOP, STAGES,
    )  # fmt: skip
    m_i, l_i, acc = _attend_keys(
        q, k_cache, v_cache, table_row, kv_off, pos, k_mid, k_hi, k_hi, window, m_i, l_i, acc,
        qk_scale, stride_cb, stride_cs, BS, BLOCK_N, D, D_PAD, PREC, True, FOR_LOOP, STAGES,
    )  # fmt: skip
    o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    o_ptrs = out_ptr + rows[:, None] * stride_ot + h * stride_oh + d[None, :]
    tl.store(o_ptrs, o.to(out_ptr.dtype.element_ty), mask=io_mask)


# The block table's row stride is the longest block table of an eager step: a runtime value (a
# specialization on it, == 1 or divisible by 16, would compile variants mid-serving).
@triton.jit(do_not_specialize=["stride_bt"])
def prefill_kernel(
    q_ptr,
    k_cache,
    v_cache,
    out_ptr,
    table_ptr,
    ctx_ptr,
    qstart_ptr,
    tiles_ptr,
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_cb,
    stride_cs,
    stride_ch,
    stride_bt,
    qk_scale,
    window,
    GROUP: tl.constexpr,
    D: tl.constexpr,
    D_PAD: tl.constexpr,
    BS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PREC: tl.constexpr,
    FOR_LOOP: tl.constexpr,
    TILE_MAP: tl.constexpr,
    STAGES: tl.constexpr,
):
    """Program (s, query tile, q head): `_prefill_program`.

    TILE_MAP (a captured step): program (i, 0, q head) takes its (s, query tile) from
    tiles_ptr[i] = s * 65536 + tile (-1: none), so the grid is sized by the step's row capacity,
    not by sequences x the longest chunk's tiles."""
    if TILE_MAP:
        code = tl.load(tiles_ptr + tl.program_id(0))
        if code < 0:
            return
        s_id = code >> 16
        tile = code & 0xFFFF
    else:
        s_id = tl.program_id(0)
        tile = tl.program_id(1)
    _prefill_program(
        s_id, tile, tl.program_id(2), q_ptr, k_cache, v_cache, out_ptr, table_ptr, ctx_ptr, qstart_ptr,
        stride_qt, stride_qh, stride_ot, stride_oh, stride_cb, stride_cs, stride_ch, stride_bt, qk_scale,
        window, GROUP, D, D_PAD, BS, BLOCK_M, BLOCK_N, PREC, FOR_LOOP, STAGES,
    )  # fmt: skip
