"""Causal attention over the paged KV cache: any mix of prefill chunks (continuing a cached prefix)
and decode rows in one step.

One interface (`AttentionBackend`: the step's K/V written into the cache, then attention), two
implementations behind it: the Triton kernels (`attention_triton.py`, imported only when built) on CUDA and
the torch reference `paged_attention_torch` elsewhere. `make_attention_backend` is the one factory;
it asks `attention_backend(device)` (`attention_metadata.py`, which also picks the metadata's
layout from it) which one a device gets. `paged_attention` is the entry point the model calls.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from loraplex.layers.attention_metadata import AttentionMetadata, attention_backend

# An implementation's entry point: `paged_attention_torch`'s signature and contract.
AttentionFunction = Callable[
    [
        torch.Tensor,
        torch.Tensor,
        torch.Tensor,
        torch.Tensor,
        torch.Tensor,
        AttentionMetadata,
        float,
        int | None,
    ],
    torch.Tensor,
]


@dataclass(frozen=True)
class AttentionBackend:
    """One attention implementation: `run` has the contract of `paged_attention_torch` (same
    arguments, same result)."""

    name: str
    run: AttentionFunction


@functools.cache
def make_attention_backend(device_type: str) -> AttentionBackend:
    """The attention implementation for a device type ("cuda", "cpu", ...), built once."""
    if attention_backend(device_type) == "triton":
        from loraplex.layers.attention_triton import paged_attention_triton  # CUDA machines only

        return AttentionBackend("triton", paged_attention_triton)
    return AttentionBackend("torch", paged_attention_torch)


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
    """Write this step's K/V into the cache, then attend each row to its sequence's cached prefix
    (semantics: `paged_attention_torch`), on the device's backend."""
    backend = make_attention_backend(q.device.type)
    return backend.run(q, k, v, k_cache, v_cache, meta, scale, sliding_window)


def paged_attention_torch(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    sliding_window: int | None,
) -> torch.Tensor:
    """Reference: write this step's K/V into the cache, then attend each row to its sequence's
    cached prefix.

    q: [T, Hq, D]; k, v: [T, Hkv, D]; k_cache, v_cache: [blocks, block_size, Hkv, D]. Returns [T, Hq, D].
    Semantics: row t at position p sees cached positions j with j <= p (and j > p - sliding_window);
    for each sequence, out[rows] = softmax(scale * q k^T over those j) v, heads grouped GQA-style
    (query head h reads kv head h // (Hq / Hkv)). Needs `meta.kv_indices`.
    """
    n_kv, head_dim = k.shape[1], k.shape[2]
    padded = meta.static  # only a captured-shape step has padding rows (slot -1: written nowhere)
    meta = meta.live(k_cache.shape[1])
    flat_k = k_cache.view(-1, n_kv, head_dim)
    flat_v = v_cache.view(-1, n_kv, head_dim)
    slots = meta.slot_mapping
    if padded:
        keep = slots >= 0
        k, v, slots = k[keep], v[keep], slots[keep]
    flat_k.index_copy_(0, slots, k)
    flat_v.index_copy_(0, slots, v)
    group = q.shape[1] // n_kv
    out = torch.zeros_like(q) if padded else torch.empty_like(q)  # padding rows of a mixed step: no sequence
    for i, ctx_len in enumerate(meta.context_lens):
        lo, hi = meta.query_start[i], meta.query_start[i + 1]
        if ctx_len == 0:  # a padding row: nothing to attend to
            out[lo:hi] = 0
            continue
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
