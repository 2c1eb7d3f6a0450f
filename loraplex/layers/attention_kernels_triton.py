"""The paged-attention Triton kernels' shared key walk and the decode kernels: one query row a
sequence, split over the context when too few programs would fill the GPU, with a combine kernel.
The prefill kernel (several query rows a sequence) is in `attention_prefill_triton.py`, the one
launch of a mixed step's decode and prefill programs in `attention_mixed_triton.py`; all walk keys
with the same tile body and read K/V through the padded block table `[S, max_blocks]` int32
(nothing is gathered). Launched by `attention_triton.paged_attention_triton`.

Layout (`docs/attention.md`): cache `[num_blocks, block_size, Hkv, D]`; query head h reads kv head
h // group. Scores, softmax state and the output accumulator are float32; P is cast to the cache
dtype for the P·V product.
"""

from __future__ import annotations

import triton
import triton.language as tl

# Running-max start: finite, so a tile with every key masked gives exp(-inf) = 0. A constexpr:
# compiled kernels may read no other kind of module global.
NEG_INIT = tl.constexpr(-1.0e30)
LOG2E = 1.4426950408889634
NO_WINDOW = 1 << 30  # "no sliding window": wider than any context, so the window test always holds
NO_WINDOW_C = tl.constexpr(NO_WINDOW)  # the same, for kernels to compare with


@triton.jit
def _attend_tile(
    q,  # [M, D_PAD] in the input dtype
    k_cache,
    v_cache,
    table_row,  # pointer to this sequence's block table row
    kv_off,  # element offset of the kv head inside a slot
    pos,  # [M] query positions (int32)
    key0,  # first key of the tile
    key_hi,  # keys >= key_hi are masked
    window,  # keys j > pos - window only (NO_WINDOW when the layer has none)
    m_i,
    l_i,
    acc,
    qk_scale,  # scale * log2(e)
    stride_cb,
    stride_cs,
    BS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    D: tl.constexpr,
    D_PAD: tl.constexpr,
    PREC: tl.constexpr,
    MASKED: tl.constexpr,
):
    """One key tile of the online softmax (base-2 exponent): returns the updated m, l, acc.

    MASKED=False: the caller vouches that every row may see every key of the tile (below the
    causal diagonal, inside the context, no window), so no mask is built and the loads take
    whole tiles."""
    j = key0 + tl.arange(0, BLOCK_N)
    d = tl.arange(0, D_PAD)
    if MASKED:
        in_ctx = j < key_hi
        blk = tl.load(table_row + j // BS, mask=in_ctx, other=0).to(tl.int64)
        addr = blk * stride_cb + (j % BS).to(tl.int64) * stride_cs + kv_off
        kv_mask = in_ctx[:, None] & (d[None, :] < D)
        k = tl.load(k_cache + addr[:, None] + d[None, :], mask=kv_mask, other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision=PREC) * qk_scale  # [M, BLOCK_N] float32
        allowed = in_ctx[None, :] & (j[None, :] <= pos[:, None]) & (j[None, :] > pos[:, None] - window)
        s = tl.where(allowed, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        p = tl.exp2(s - m_new[:, None])
        v = tl.load(v_cache + addr[:, None] + d[None, :], mask=kv_mask, other=0.0)
    else:
        blk = tl.load(table_row + j // BS).to(tl.int64)
        addr = blk * stride_cb + (j % BS).to(tl.int64) * stride_cs + kv_off
        k = tl.load(k_cache + addr[:, None] + d[None, :], mask=d[None, :] < D, other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision=PREC)  # unscaled: the scale goes into exp2's FMA
        m_new = tl.maximum(m_i, tl.max(s, axis=1) * qk_scale)
        p = tl.exp2(s * qk_scale - m_new[:, None])
        v = tl.load(v_cache + addr[:, None] + d[None, :], mask=d[None, :] < D, other=0.0)
    alpha = tl.exp2(m_i - m_new)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PREC)
    l_i = l_i * alpha + tl.sum(p, axis=1)
    return m_new, l_i, acc


@triton.jit
def _attend_keys(
    q, k_cache, v_cache, table_row, kv_off, pos, key_lo, key_end, key_hi, window, m_i, l_i, acc, qk_scale,
    stride_cb, stride_cs, BS: tl.constexpr, BLOCK_N: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr,
    PREC: tl.constexpr, MASKED: tl.constexpr, FOR_LOOP: tl.constexpr, STAGES: tl.constexpr,
):  # fmt: skip
    """`_attend_tile` over the key tiles from key_lo (step BLOCK_N) while below key_end: a for loop
    over runtime bounds on the GPU (software-pipelined by the compiler, STAGES deep: a loop's own
    depth, so one kernel can hold walks of different depths), a while loop over the same tiles in
    the interpreter (numpy >= 2.4 refuses a loaded scalar as a `range` bound)."""
    if FOR_LOOP:
        for key0 in tl.range(key_lo, key_end, BLOCK_N, num_stages=STAGES):
            m_i, l_i, acc = _attend_tile(
                q, k_cache, v_cache, table_row, kv_off, pos, key0, key_hi, window, m_i, l_i, acc,
                qk_scale, stride_cb, stride_cs, BS, BLOCK_N, D, D_PAD, PREC, MASKED,
            )  # fmt: skip
    else:
        key0 = key_lo
        while key0 < key_end:
            m_i, l_i, acc = _attend_tile(
                q, k_cache, v_cache, table_row, kv_off, pos, key0, key_hi, window, m_i, l_i, acc,
                qk_scale, stride_cb, stride_cs, BS, BLOCK_N, D, D_PAD, PREC, MASKED,
            )  # fmt: skip
            key0 += BLOCK_N
    return m_i, l_i, acc


# Pipeline depth of the decode walk (Triton's default for a kernel launched without one).
DECODE_STAGES = tl.constexpr(3)


@triton.jit
def _decode_program(
    s_id, kvh, split, n_kv, q_ptr, k_cache, v_cache, out_ptr, part_acc, part_ml, table_ptr, ctx_ptr,
    qstart_ptr, stride_qt, stride_qh, stride_ot, stride_oh, stride_cb, stride_cs, stride_ch, stride_bt,
    qk_scale, window, GROUP: tl.constexpr, G_PAD: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr,
    BS: tl.constexpr, BLOCK_N: tl.constexpr, SPLITS: tl.constexpr, PREC: tl.constexpr,
    FOR_LOOP: tl.constexpr, STAGES: tl.constexpr,
):  # fmt: skip
    """Decode program (s, kv head, split) of `n_kv` kv heads: the GROUP query heads of one kv head
    of a one-row sequence, over the split's keys; K/V of that kv head are read once for all its
    query heads."""
    row = tl.load(qstart_ptr + s_id)
    if tl.load(qstart_ptr + s_id + 1) - row != 1:
        return
    ctx = tl.load(ctx_ptr + s_id)
    p_last = ctx - 1
    lo = tl.maximum(p_last - window + 1, 0)
    # Each sequence splits its own keys (whole BLOCK_N tiles per split): no launch argument depends
    # on the step's context lengths, so a CUDA graph can replay this launch for any of them.
    keys_per_split = tl.cdiv(tl.cdiv(ctx - lo, SPLITS), BLOCK_N) * BLOCK_N
    k_lo = lo + split * keys_per_split
    k_hi = tl.minimum(ctx, k_lo + keys_per_split)
    g = tl.arange(0, G_PAD)
    d = tl.arange(0, D_PAD)
    heads = kvh * GROUP + g
    q_mask = (g[:, None] < GROUP) & (d[None, :] < D)
    row64 = row.to(tl.int64)
    q = tl.load(q_ptr + row64 * stride_qt + heads[:, None] * stride_qh + d[None, :], mask=q_mask, other=0.0)
    pos = tl.zeros([G_PAD], dtype=tl.int32) + p_last
    m_i = tl.zeros([G_PAD], dtype=tl.float32) + NEG_INIT
    l_i = tl.zeros([G_PAD], dtype=tl.float32)
    acc = tl.zeros([G_PAD, D_PAD], dtype=tl.float32)
    table_row = table_ptr + s_id.to(tl.int64) * stride_bt
    m_i, l_i, acc = _attend_keys(
        q, k_cache, v_cache, table_row, kvh * stride_ch, pos, k_lo, k_hi, k_hi, window, m_i, l_i, acc,
        qk_scale, stride_cb, stride_cs, BS, BLOCK_N, D, D_PAD, PREC, True, FOR_LOOP, STAGES,
    )  # fmt: skip
    if SPLITS == 1:
        o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        o_ptrs = out_ptr + row64 * stride_ot + heads[:, None] * stride_oh + d[None, :]
        tl.store(o_ptrs, o.to(out_ptr.dtype.element_ty), mask=q_mask)
    else:
        base = (s_id.to(tl.int64) * (GROUP * n_kv) + heads) * SPLITS + split  # [G_PAD]
        tl.store(part_acc + base[:, None] * D_PAD + d[None, :], acc, mask=g[:, None] < GROUP)
        tl.store(part_ml + base * 2, m_i, mask=g < GROUP)
        tl.store(part_ml + base * 2 + 1, l_i, mask=g < GROUP)


# The block table's row stride is the longest block table of an eager step: a runtime value (a
# specialization on it, == 1 or divisible by 16, would compile variants mid-serving).
@triton.jit(do_not_specialize=["stride_bt"])
def decode_kernel(
    q_ptr,
    k_cache,
    v_cache,
    out_ptr,
    part_acc,  # [S, Hq, SPLITS, D_PAD] float32 (SPLITS > 1 only)
    part_ml,  # [S, Hq, SPLITS, 2] float32: running max (base 2) and sum
    table_ptr,
    ctx_ptr,
    qstart_ptr,
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
    G_PAD: tl.constexpr,
    D: tl.constexpr,
    D_PAD: tl.constexpr,
    BS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SPLITS: tl.constexpr,
    PREC: tl.constexpr,
    FOR_LOOP: tl.constexpr,
):
    """Program (s, kv head, split): `_decode_program`."""
    _decode_program(
        tl.program_id(0), tl.program_id(1), tl.program_id(2), tl.num_programs(1), q_ptr, k_cache,
        v_cache, out_ptr, part_acc, part_ml, table_ptr, ctx_ptr, qstart_ptr, stride_qt, stride_qh,
        stride_ot, stride_oh, stride_cb, stride_cs, stride_ch, stride_bt, qk_scale, window, GROUP, G_PAD,
        D, D_PAD, BS, BLOCK_N, SPLITS, PREC, FOR_LOOP, DECODE_STAGES,
    )  # fmt: skip


@triton.jit
def decode_combine_kernel(
    out_ptr,
    part_acc,
    part_ml,
    qstart_ptr,
    stride_ot,
    stride_oh,
    HQ: tl.constexpr,
    D: tl.constexpr,
    D_PAD: tl.constexpr,
    SPLITS: tl.constexpr,
):
    """Program (s, q head): merge the SPLITS partial softmax states of a one-row sequence."""
    s_id = tl.program_id(0)
    h = tl.program_id(1)
    row = tl.load(qstart_ptr + s_id)
    if tl.load(qstart_ptr + s_id + 1) - row != 1:
        return
    sp = tl.arange(0, SPLITS)
    d = tl.arange(0, D_PAD)
    base = (s_id.to(tl.int64) * HQ + h) * SPLITS + sp
    m = tl.load(part_ml + base * 2)
    l_part = tl.load(part_ml + base * 2 + 1)
    m_all = tl.max(m, axis=0)
    w = tl.exp2(m - m_all)  # a split with no keys has m = NEG_INIT, l = 0: weight 0
    acc = tl.load(part_acc + base[:, None] * D_PAD + d[None, :])
    den = tl.sum(l_part * w, axis=0)
    o = tl.sum(acc * w[:, None], axis=0) / tl.where(den > 0, den, 1.0)  # no keys (padding row): 0
    tl.store(
        out_ptr + row.to(tl.int64) * stride_ot + h * stride_oh + d, o.to(out_ptr.dtype.element_ty), mask=d < D
    )
