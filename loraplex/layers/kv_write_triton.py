"""The KV-cache write of one step on the GPU: each row's K and V into its cache slot, one launch
for both (slot -1: a padding row, written nowhere). Used by `attention_triton.paged_attention_triton`
before the attention launches."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def kv_write_kernel(
    k_ptr,
    v_ptr,
    k_cache,
    v_cache,
    slot_ptr,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_cs,  # cache stride of one slot (block * block_size + offset) in elements
    stride_ch,
    HKV: tl.constexpr,
    D: tl.constexpr,
    H_PAD: tl.constexpr,
    D_PAD: tl.constexpr,
):
    """Row t: k_cache/v_cache[slot[t]] = k/v[t] (all kv heads). Negative slots are skipped."""
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if slot < 0:
        return
    h = tl.arange(0, H_PAD)[:, None]
    d = tl.arange(0, D_PAD)[None, :]
    mask = (h < HKV) & (d < D)
    src_k = tl.load(k_ptr + t * stride_kt + h * stride_kh + d, mask=mask)
    src_v = tl.load(v_ptr + t * stride_vt + h * stride_vh + d, mask=mask)
    tl.store(k_cache + slot * stride_cs + h * stride_ch + d, src_k, mask=mask)
    tl.store(v_cache + slot * stride_cs + h * stride_ch + d, src_v, mask=mask)


def write_kv(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor
):
    """k_cache.view(-1, Hkv, D)[slots] = k (and v), in one launch for both."""
    t, n_kv, head_dim = k.shape
    if t == 0:
        return
    assert k.stride(2) == 1 and v.stride(2) == 1 and k_cache.is_contiguous() and v_cache.is_contiguous()
    assert k_cache.stride() == v_cache.stride()
    kv_write_kernel[(t,)](
        k, v, k_cache, v_cache, slots,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(1), k_cache.stride(2),
        HKV=n_kv, D=head_dim, H_PAD=triton.next_power_of_2(n_kv), D_PAD=triton.next_power_of_2(head_dim),
    )  # fmt: skip
