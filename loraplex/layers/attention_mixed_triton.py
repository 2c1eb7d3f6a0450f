"""A captured mixed step's attention in one launch: the prefill query tiles' programs first, then the
decode programs, on one grid.

Why one launch: the prefill programs of a chunk are few and long (each walks its tile's keys one
after the other), the decode programs many and short. Launched separately, even on two streams, the
decode launch fills the SMs first and the prefill programs mostly run after it. Ordered first on
one grid, the long programs start at once and the decode programs fill the SMs around them, the
way a longest-first schedule packs jobs.

Program ids: first (entry, q head) for the tile map's first n_tile_entries entries, entry-major;
then (sequence, kv head, split) of the decode launch; last (entry, q head) for the map's other
entries. An entry of -1 returns at once. The map holds its real entries first, and its capacity
(R / tile rows + S entries, for a step of S sequences each with a short chunk) is mostly -1 in a
serving step, whose chunk or two fill about R / tile rows + 1 entries: placed before the decode
programs, the -1 entries' programs (~10x the real ones) would hold the decode programs queued
behind them. Launched by `attention_triton.paged_attention_triton`.
"""

from __future__ import annotations

import triton
import triton.language as tl

from loraplex.layers.attention_kernels_triton import _decode_program
from loraplex.layers.attention_prefill_triton import _prefill_program


# The tile map's sizes are runtime values, like the block table's row stride (a specialization on
# any would compile variants per token bucket or mid-serving).
@triton.jit(do_not_specialize=["stride_bt", "n_tile_entries", "n_seqs"])
def mixed_step_kernel(
    q_ptr,
    k_cache,
    v_cache,
    out_ptr,
    part_acc,  # decode split-K state, as `decode_kernel` (SPLITS > 1 only)
    part_ml,
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
    n_tile_entries,
    n_seqs,
    GROUP: tl.constexpr,
    G_PAD: tl.constexpr,
    HKV: tl.constexpr,
    D: tl.constexpr,
    D_PAD: tl.constexpr,
    BS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    PREFILL_BLOCK_N: tl.constexpr,
    PREFILL_STAGES: tl.constexpr,
    DECODE_BLOCK_N: tl.constexpr,
    DECODE_STAGES: tl.constexpr,
    SPLITS: tl.constexpr,
    PREC: tl.constexpr,
    FOR_LOOP: tl.constexpr,
):
    """One program of either launch (see the module doc)."""
    pid = tl.program_id(0)
    n_heads = HKV * GROUP
    n_front = n_tile_entries * n_heads
    n_decode = n_seqs * (HKV * SPLITS)
    if pid < n_front:
        _tile_program(
            pid, tiles_ptr, n_heads, q_ptr, k_cache, v_cache, out_ptr, table_ptr, ctx_ptr, qstart_ptr,
            stride_qt, stride_qh, stride_ot, stride_oh, stride_cb, stride_cs, stride_ch, stride_bt, qk_scale,
            window, GROUP, D, D_PAD, BS, BLOCK_M, PREFILL_BLOCK_N, PREC, FOR_LOOP, PREFILL_STAGES,
        )  # fmt: skip
    elif pid >= n_front + n_decode:
        _tile_program(
            pid - n_decode, tiles_ptr, n_heads, q_ptr, k_cache, v_cache, out_ptr, table_ptr, ctx_ptr,
            qstart_ptr, stride_qt, stride_qh, stride_ot, stride_oh, stride_cb, stride_cs, stride_ch,
            stride_bt, qk_scale, window, GROUP, D, D_PAD, BS, BLOCK_M, PREFILL_BLOCK_N, PREC, FOR_LOOP,
            PREFILL_STAGES,
        )  # fmt: skip
    else:
        d = pid - n_front
        s_id = d // (HKV * SPLITS)
        rest = d % (HKV * SPLITS)
        _decode_program(
            s_id, rest // SPLITS, rest % SPLITS, HKV, q_ptr, k_cache, v_cache, out_ptr, part_acc, part_ml,
            table_ptr, ctx_ptr, qstart_ptr, stride_qt, stride_qh, stride_ot, stride_oh, stride_cb, stride_cs,
            stride_ch, stride_bt, qk_scale, window, GROUP, G_PAD, D, D_PAD, BS, DECODE_BLOCK_N, SPLITS, PREC,
            FOR_LOOP, DECODE_STAGES,
        )  # fmt: skip


@triton.jit
def _tile_program(
    p, tiles_ptr, n_heads, q_ptr, k_cache, v_cache, out_ptr, table_ptr, ctx_ptr, qstart_ptr, stride_qt,
    stride_qh, stride_ot, stride_oh, stride_cb, stride_cs, stride_ch, stride_bt, qk_scale, window,
    GROUP: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr, BS: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, PREC: tl.constexpr, FOR_LOOP: tl.constexpr, STAGES: tl.constexpr,
):  # fmt: skip
    """Prefill program p: the tile map's entry p // n_heads (none if -1), query head p % n_heads."""
    code = tl.load(tiles_ptr + p // n_heads)
    if code >= 0:
        _prefill_program(
            code >> 16, code & 0xFFFF, p % n_heads, q_ptr, k_cache, v_cache, out_ptr, table_ptr, ctx_ptr,
            qstart_ptr, stride_qt, stride_qh, stride_ot, stride_oh, stride_cb, stride_cs, stride_ch,
            stride_bt, qk_scale, window, GROUP, D, D_PAD, BS, BLOCK_M, BLOCK_N, PREC, FOR_LOOP, STAGES,
        )  # fmt: skip
