"""Paged attention on the GPU: the `paged_attention_torch` contract on the Triton kernels of
`attention_kernels_triton.py`, `attention_prefill_triton.py` and `attention_mixed_triton.py`.

One step = one KV write launch, then a decode launch (sequences with one query row, plus a combine
launch when split over the context) and/or a prefill launch (sequences with several query rows).
A captured mixed step (a tile map) runs both as one launch, prefill programs first; an eager step
with both runs the prefill launch on a side stream beside the decode launch. Imported
only by `attention.paged_attention` on CUDA (or by tests that run it under `TRITON_INTERPRET=1`),
so the package imports without triton.
"""

from __future__ import annotations

import threading

import torch
import triton

from loraplex.layers.attention_kernels_triton import (
    DECODE_STAGES,
    LOG2E,
    NO_WINDOW,
    decode_combine_kernel,
    decode_kernel,
)
from loraplex.layers.attention_metadata import AttentionMetadata
from loraplex.layers.attention_mixed_triton import mixed_step_kernel
from loraplex.layers.attention_prefill_triton import prefill_kernel
from loraplex.layers.attention_tiling import (
    AttentionTiling,
    decode_splits,
    num_sms,
    tiling_for,
)
from loraplex.layers.kv_write_triton import write_kv

__all__ = [
    "decode_combine_kernel",
    "decode_kernel",
    "mixed_step_kernel",
    "paged_attention_triton",
    "prefill_kernel",
]


# A captured mixed step's one launch runs the prefill programs of the tile map's first entries (as
# many as the step's row tiles, plus these) before its decode programs, the rest after them
# (`attention_mixed_triton.py`).
SPARE_TILE_ENTRIES = 2


def _pow2(n: int, lo: int = 16) -> int:
    return max(lo, triton.next_power_of_2(n))


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def paged_attention_triton(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    sliding_window: int | None,
    tiling: AttentionTiling | None = None,
    splits: int | None = None,
) -> torch.Tensor:
    """`paged_attention_torch` (same arguments, same result) on the kernels; needs the metadata's
    device tensors (`AttentionMetadata.build(..., for_kernels=True)`). `splits` overrides the
    decode split-K factor (a power of two up to `tiling.max_splits`; the warm-up compiles each)."""
    assert meta.block_table is not None and meta.context_lens_t is not None and meta.query_start_t is not None
    n_tok, n_q, head_dim = q.shape
    n_kv = k.shape[1]
    assert n_q % n_kv == 0 and q.stride(2) == 1
    tiling = tiling or tiling_for(head_dim)
    write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
    # A captured mixed step's padding rows belong to no sequence, so no launch writes them: they
    # hold what the memory held, and every later op keeps rows apart, so none reaches a real row.
    out = torch.empty((n_tok, n_q, head_dim), dtype=q.dtype, device=q.device)
    n_seq = meta.num_seqs
    if n_tok == 0 or n_seq == 0:
        return out
    group = n_q // n_kv
    d_pad = _pow2(head_dim)
    bs = k_cache.shape[1]
    window = int(sliding_window) if sliding_window else NO_WINDOW
    prec = "ieee" if q.dtype == torch.float32 else "tf32"
    qk_scale = float(scale) * LOG2E
    for_loop = q.device.type == "cuda"
    cache_strides = (k_cache.stride(0), k_cache.stride(1), k_cache.stride(2))
    table = meta.block_table
    # A mixed step's decode rows (memory-bound) and prefill chunks (few long programs, too few to
    # fill the GPU alone) write disjoint rows. Captured (a tile map): one launch, prefill programs
    # first (`attention_mixed_triton.py`). Eager: the prefill launch goes on a side stream forked
    # from and joined back into the current one, so the two overlap; the join comes before
    # anything else reads `out`.
    mixed = meta.num_decode_seqs > 0 and meta.max_query_len > 1
    one_launch = mixed and meta.prefill_tiles is not None
    side = _side_stream(q.device) if mixed and not one_launch else None
    if side is not None:
        side.wait_stream(torch.cuda.current_stream(q.device))
    if meta.max_query_len > 1 and not one_launch:
        with torch.cuda.stream(side):  # (None: the current stream)
            _launch_prefill(q, k_cache, v_cache, out, meta, cache_strides, qk_scale, window, group,
                            d_pad, bs, prec, for_loop, tiling)  # fmt: skip
    if meta.num_decode_seqs:
        keys = min(meta.max_context_len, window)
        block_n = tiling.decode_block_n
        if splits is None:
            splits = decode_splits(meta.num_decode_seqs, n_kv, keys, num_sms(q.device), tiling)
        if splits > 1:
            part_acc = torch.empty((n_seq, n_q, splits, d_pad), dtype=torch.float32, device=q.device)
            part_ml = torch.empty((n_seq, n_q, splits, 2), dtype=torch.float32, device=q.device)
        else:
            part_acc = part_ml = out  # unused
        common = (q, k_cache, v_cache, out, part_acc, part_ml, table, meta.context_lens_t, meta.query_start_t)
        strides = (q.stride(0), q.stride(1), out.stride(0), out.stride(1), *cache_strides, table.stride(0))
        if one_launch:
            tiles = meta.prefill_tiles
            assert tiles is not None and meta.prefill_tile_rows == tiling.prefill_block_m
            cap = tiles.shape[0]
            entries = min(cap, _cdiv(n_tok, tiling.prefill_block_m) + SPARE_TILE_ENTRIES)
            mixed_step_kernel[(cap * n_q + n_seq * n_kv * splits,)](
                *common, tiles, *strides, qk_scale, window, entries, n_seq,
                GROUP=group, G_PAD=_pow2(group), HKV=n_kv, D=head_dim, D_PAD=d_pad, BS=bs,
                BLOCK_M=tiling.prefill_block_m, PREFILL_BLOCK_N=tiling.prefill_block_n,
                PREFILL_STAGES=tiling.prefill_num_stages, DECODE_BLOCK_N=block_n,
                DECODE_STAGES=DECODE_STAGES.value, SPLITS=splits, PREC=prec, FOR_LOOP=for_loop,
                num_warps=tiling.num_warps, **_register_cap(tiling),
            )  # fmt: skip
        else:
            decode_kernel[(n_seq, n_kv, splits)](
                *common, *strides, qk_scale, window,
                GROUP=group, G_PAD=_pow2(group), D=head_dim, D_PAD=d_pad, BS=bs, BLOCK_N=block_n,
                SPLITS=splits, PREC=prec, FOR_LOOP=for_loop, num_warps=tiling.num_warps,
            )  # fmt: skip
        if splits > 1:
            decode_combine_kernel[(n_seq, n_q)](
                out, part_acc, part_ml, meta.query_start_t, out.stride(0), out.stride(1),
                HQ=n_q, D=head_dim, D_PAD=d_pad, SPLITS=splits,
            )  # fmt: skip
    if side is not None:
        torch.cuda.current_stream(q.device).wait_stream(side)
    return out


def _register_cap(tiling: AttentionTiling) -> dict[str, int]:
    """The one launch's register cap as a launch option (none: the compiler's choice)."""
    cap = tiling.one_launch_max_registers
    return {"maxnreg": cap} if cap else {}


def _launch_prefill(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    out: torch.Tensor,
    meta: AttentionMetadata,
    cache_strides: tuple[int, int, int],
    qk_scale: float,
    window: int,
    group: int,
    d_pad: int,
    bs: int,
    prec: str,
    for_loop: bool,
    tiling: AttentionTiling,
) -> None:
    """The prefill launch: every sequence with >= 2 query rows (by the step's tile map when the
    step was captured)."""
    table = meta.block_table
    assert table is not None
    n_q, head_dim = q.shape[1], q.shape[2]
    block_m = tiling.prefill_block_m
    tiles = meta.prefill_tiles
    if tiles is not None:
        assert meta.prefill_tile_rows == block_m, "the step's tile map was cut for other tiles"
        grid = (tiles.shape[0], 1, n_q)
    else:
        tiles = meta.query_start_t  # unread
        grid = (meta.num_seqs, _cdiv(meta.max_query_len, block_m), n_q)
    prefill_kernel[grid](
        q, k_cache, v_cache, out, table, meta.context_lens_t, meta.query_start_t, tiles,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), *cache_strides, table.stride(0),
        qk_scale, window,
        GROUP=group, D=head_dim, D_PAD=d_pad, BS=bs, BLOCK_M=block_m, BLOCK_N=tiling.prefill_block_n,
        PREC=prec, FOR_LOOP=for_loop, TILE_MAP=meta.prefill_tiles is not None,
        STAGES=tiling.prefill_num_stages, num_warps=tiling.num_warps,
    )  # fmt: skip


# Per thread: an engine steps (and captures its graphs) on its own thread, and a stream that one
# thread's capture has forked into must not take another thread's launches meanwhile.
_SIDE_STREAMS = threading.local()


def _side_stream(device: torch.device) -> torch.cuda.Stream | None:
    """The stream a mixed step's prefill launch runs on beside the decode launch (CUDA only)."""
    if device.type != "cuda":
        return None
    if not hasattr(_SIDE_STREAMS, "by_device"):
        _SIDE_STREAMS.by_device = {}
    streams: dict[torch.device, torch.cuda.Stream] = _SIDE_STREAMS.by_device
    stream = streams.get(device)
    if stream is None:
        stream = streams[device] = torch.cuda.Stream(device)
    return stream
