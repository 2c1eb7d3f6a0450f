"""Causal attention over the paged KV cache (torch reference path; any mix of prefill chunks and
decode rows in one step)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class AttentionMetadata:
    """Per step, shared by every layer. Rows of one sequence are contiguous, in position order."""

    positions: torch.Tensor  # [T] int64: absolute position of each row
    slot_mapping: torch.Tensor  # [T] int64: flat cache slot (block * block_size + offset) per row
    query_start: tuple[int, ...]  # [S + 1] host: rows of sequence i are query_start[i]:query_start[i+1]
    context_lens: tuple[int, ...]  # [S] host: tokens in the cache for sequence i after this step
    kv_indices: tuple[torch.Tensor, ...]  # [S] of [context_len] int64: flat cache slots of positions 0..len-1
    block_tables: tuple[tuple[int, ...], ...]  # [S] block ids per sequence (kernels on the GPU read these)

    @property
    def num_seqs(self) -> int:
        return len(self.context_lens)


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    sliding_window: int | None,
) -> torch.Tensor:
    """Write this step's K/V into the cache, then attend each row to its sequence's cached prefix.

    q: [T, Hq, D]; k, v: [T, Hkv, D]; k_cache, v_cache: [blocks, block_size, Hkv, D]. Returns [T, Hq, D].
    Row t at position p sees cached positions j with j <= p (and j > p - sliding_window).
    """
    n_kv, head_dim = k.shape[1], k.shape[2]
    flat_k = k_cache.view(-1, n_kv, head_dim)
    flat_v = v_cache.view(-1, n_kv, head_dim)
    flat_k.index_copy_(0, meta.slot_mapping, k)
    flat_v.index_copy_(0, meta.slot_mapping, v)
    group = q.shape[1] // n_kv
    out = torch.empty_like(q)
    for i, ctx_len in enumerate(meta.context_lens):
        lo, hi = meta.query_start[i], meta.query_start[i + 1]
        idx = meta.kv_indices[i]
        keys = flat_k.index_select(0, idx)  # [L, Hkv, D]
        values = flat_v.index_select(0, idx)
        if group > 1:
            keys = keys.repeat_interleave(group, dim=1)
            values = values.repeat_interleave(group, dim=1)
        q_pos = meta.positions[lo:hi, None]  # [n, 1]
        k_pos = torch.arange(ctx_len, device=q.device)[None, :]  # [1, L]
        allowed = k_pos <= q_pos
        if sliding_window is not None:
            allowed &= k_pos > q_pos - sliding_window
        # [H, n, D] x [H, L, D] -> [H, n, D]
        o = F.scaled_dot_product_attention(
            q[lo:hi].transpose(0, 1),
            keys.transpose(0, 1),
            values.transpose(0, 1),
            attn_mask=allowed,
            scale=scale,
        )
        out[lo:hi] = o.transpose(0, 1)
    return out
