"""Fused elementwise kernels for the decoder layer: add + RMSNorm, RoPE on q and k (optionally with
Qwen3's per-head q/k RMSNorm first), SiLU(gate) * up.

Each replaces a chain of small torch kernels with one launch. They keep the rounding points of
the torch code in `norm.py`, `rotary.py` and `llama.py` (which follow transformers): every value
the torch code materialises in the activation dtype is rounded to it here too, everything else is
float32. Launch grids and allocations depend on shapes only (no host syncs), so the ops can be
captured in CUDA graphs. Imported only for CUDA tensors (and by the interpreter tests).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rmsnorm_kernel(
    x_ptr,
    res_ptr,
    w_ptr,
    out_ptr,
    stride_x,
    stride_r,
    stride_o,
    eps,
    D: tl.constexpr,
    BLOCK: tl.constexpr,
    HAS_RES: tl.constexpr,
):
    # One program per row. With HAS_RES: res <- res + x (rounded to the activation dtype, as a
    # torch add would), and the norm is of that rounded sum.
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < D
    dt = x_ptr.dtype.element_ty
    h = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    if HAS_RES:
        r = tl.load(res_ptr + row * stride_r + cols, mask=mask, other=0.0)
        h = (h.to(tl.float32) + r.to(tl.float32)).to(dt)
        tl.store(res_ptr + row * stride_r + cols, h, mask=mask)
    h = h.to(tl.float32)
    inv = tl.math.rsqrt(tl.sum(h * h, axis=0) / D + eps)
    # transformers: weight * hidden.to(dtype), i.e. the normalised value is rounded before the scale
    normed = (h * inv).to(dt).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, (w * normed).to(dt), mask=mask)


@triton.jit
def _rope_heads(
    base,
    stride_h,
    n_heads,
    cos,
    sin,
    w_ptr,
    eps,
    HALF: tl.constexpr,
    H_PAD: tl.constexpr,
    HALF_PAD: tl.constexpr,
    NORM: tl.constexpr,
):
    # All heads of one token, in place: [H_PAD, HALF_PAD] tiles of the first and second halves.
    dt = base.dtype.element_ty
    h = tl.arange(0, H_PAD)[:, None]
    j = tl.arange(0, HALF_PAD)[None, :]
    mask = (h < n_heads) & (j < HALF)
    p1 = base + h * stride_h + j
    x1 = tl.load(p1, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(p1 + HALF, mask=mask, other=0.0).to(tl.float32)
    if NORM:
        inv = tl.math.rsqrt((tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1)) / (2 * HALF) + eps)
        inv = inv[:, None]
        w1 = tl.load(w_ptr + j, mask=j < HALF, other=0.0).to(tl.float32)
        w2 = tl.load(w_ptr + HALF + j, mask=j < HALF, other=0.0).to(tl.float32)
        x1 = (w1 * (x1 * inv).to(dt).to(tl.float32)).to(dt).to(tl.float32)
        x2 = (w2 * (x2 * inv).to(dt).to(tl.float32)).to(dt).to(tl.float32)
    # q * cos + rotate_half(q) * sin with each product rounded like the torch expression; the
    # products of two activation-dtype values are exact in float32, so bf16/fp16 results are
    # bit-identical to it.
    o1 = (x1 * cos).to(dt).to(tl.float32) - (x2 * sin).to(dt).to(tl.float32)
    o2 = (x2 * cos).to(dt).to(tl.float32) + (x1 * sin).to(dt).to(tl.float32)
    tl.store(p1, o1.to(dt), mask=mask)
    tl.store(p1 + HALF, o2.to(dt), mask=mask)


@triton.jit
def _rotary_kernel(
    q_ptr,
    k_ptr,
    pos_ptr,
    cache_ptr,
    qw_ptr,
    kw_ptr,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_c,
    eps_q,
    eps_k,
    HQ: tl.constexpr,
    HKV: tl.constexpr,
    HALF: tl.constexpr,
    HQ_PAD: tl.constexpr,
    HKV_PAD: tl.constexpr,
    HALF_PAD: tl.constexpr,
    NORM: tl.constexpr,
):
    # One program per token: gather its cos/sin row once, rotate every q and k head.
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + t).to(tl.int64)
    j = tl.arange(0, HALF_PAD)[None, :]
    row = cache_ptr + pos * stride_c + j
    dt = q_ptr.dtype.element_ty
    # transformers rounds cos and sin to the activation dtype before using them
    cos = tl.load(row, mask=j < HALF, other=0.0).to(dt).to(tl.float32)
    sin = tl.load(row + HALF, mask=j < HALF, other=0.0).to(dt).to(tl.float32)
    _rope_heads(q_ptr + t * stride_qt, stride_qh, HQ, cos, sin, qw_ptr, eps_q, HALF, HQ_PAD, HALF_PAD, NORM)
    _rope_heads(k_ptr + t * stride_kt, stride_kh, HKV, cos, sin, kw_ptr, eps_k, HALF, HKV_PAD, HALF_PAD, NORM)


@triton.jit
def _silu_mul_kernel(
    x_ptr, d_ptr, out_ptr, stride_x, stride_d, stride_o, N, BLOCK: tl.constexpr, HAS_DELTA: tl.constexpr
):
    # grid (rows, column blocks): out[t, c] = silu(x[t, c]) * x[t, N + c], with x += d first
    # (rounded to the activation dtype, as the in-place LoRA add into x would leave it)
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < N
    dt = x_ptr.dtype.element_ty
    g = tl.load(x_ptr + t * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(x_ptr + t * stride_x + N + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_DELTA:
        dg = tl.load(d_ptr + t * stride_d + cols, mask=mask, other=0.0).to(tl.float32)
        du = tl.load(d_ptr + t * stride_d + N + cols, mask=mask, other=0.0).to(tl.float32)
        g = (g + dg).to(dt).to(tl.float32)
        u = (u + du).to(dt).to(tl.float32)
    act = (g / (1.0 + tl.exp(-g))).to(dt).to(tl.float32)  # F.silu's output, in the activation dtype
    tl.store(out_ptr + t * stride_o + cols, (act * u).to(dt), mask=mask)


def _norm_warps(block: int) -> int:
    # about 16 elements per thread; one row never needs more than 16 warps
    return max(1, min(16, block // 512))


def _launch_norm(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> torch.Tensor:
    rows, d = x.shape
    out = torch.empty((rows, d), dtype=x.dtype, device=x.device)
    if rows == 0:
        return out
    block = triton.next_power_of_2(d)
    res = x if residual is None else residual
    _rmsnorm_kernel[(rows,)](
        x, res, weight, out, x.stride(0), res.stride(0), out.stride(0), float(eps),
        D=d, BLOCK=block, HAS_RES=residual is not None, num_warps=_norm_warps(block),
    )  # fmt: skip
    return out


def rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """`norm.rms_norm_torch` in one launch: x [..., D] -> [..., D] (a new contiguous tensor)."""
    d = x.shape[-1]
    assert weight.shape == (d,) and weight.is_contiguous()
    x2 = x.reshape(-1, d)  # a view for row-strided 2-D inputs, a copy only for odd layouts
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    return _launch_norm(x2, None, weight, eps).view(x.shape)


def fused_add_rmsnorm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> torch.Tensor:
    """residual <- residual + x (in place, in the activation dtype); returns rmsnorm(residual) *
    weight with `rmsnorm`'s numerics. x, residual: [T, D], unit stride along D."""
    assert x.dim() == 2 and x.shape == residual.shape and x.dtype == residual.dtype
    assert x.stride(1) == 1 and residual.stride(1) == 1
    assert weight.shape == (x.shape[1],) and weight.is_contiguous()
    return _launch_norm(x, residual, weight, eps)


def rotary_qk_(
    q: torch.Tensor,
    k: torch.Tensor,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    q_norm: tuple[torch.Tensor, float] | None = None,
    k_norm: tuple[torch.Tensor, float] | None = None,
) -> None:
    """RoPE (half-rotation layout) on q [T, Hq, D] and k [T, Hkv, D] in place; both may be strided
    views (unit stride along D only). cos_sin_cache: float32 [max_pos, D], cos of position p in
    row p's first D/2 columns, sin in the last D/2; every position must be < max_pos. q_norm /
    k_norm, (weight [D], eps), apply Qwen3's per-head RMSNorm before the rotation, in the same launch."""
    t, n_q, d = q.shape
    n_kv = k.shape[1]
    assert k.shape == (t, n_kv, d) and k.dtype == q.dtype and d % 2 == 0
    assert q.stride(2) == 1 and k.stride(2) == 1
    table = cos_sin_cache
    assert table.dtype == torch.float32 and table.shape[1] == d and table.stride(1) == 1
    assert positions.shape == (t,) and positions.device == q.device == table.device
    assert (q_norm is None) == (k_norm is None)
    if t == 0:
        return
    half = d // 2
    norm = q_norm is not None and k_norm is not None
    qw, eps_q = q_norm if norm and q_norm is not None else (table, 0.0)  # the weights are unread without NORM
    kw, eps_k = k_norm if norm and k_norm is not None else (table, 0.0)
    h_pad, half_pad = triton.next_power_of_2(n_q), triton.next_power_of_2(half)
    _rotary_kernel[(t,)](
        q, k, positions, table, qw, kw,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), table.stride(0), float(eps_q), float(eps_k),
        HQ=n_q, HKV=n_kv, HALF=half, HQ_PAD=h_pad, HKV_PAD=triton.next_power_of_2(n_kv), HALF_PAD=half_pad,
        NORM=norm, num_warps=8 if h_pad * half_pad >= 4096 else 4,
        enable_fp_fusion=False,  # an FMA would skip a product's rounding: results 1 ulp off torch's
    )  # fmt: skip


def silu_mul(gate_up: torch.Tensor, delta: torch.Tensor | None = None) -> torch.Tensor:
    """gate_up [T, 2I] (gate columns first, unit column stride) -> silu(gate) * up, [T, I];
    with delta (same shape), of gate_up + delta (a concurrent LoRA step's gate_up output)."""
    t, two_i = gate_up.shape
    assert two_i % 2 == 0 and gate_up.stride(1) == 1
    if delta is not None:
        assert delta.shape == gate_up.shape and delta.stride(1) == 1 and delta.dtype == gate_up.dtype
    n = two_i // 2
    out = torch.empty((t, n), dtype=gate_up.dtype, device=gate_up.device)
    if t == 0:
        return out
    block = min(1024, triton.next_power_of_2(n))
    d = gate_up if delta is None else delta
    _silu_mul_kernel[(t, triton.cdiv(n, block))](
        gate_up, d, out, gate_up.stride(0), d.stride(0), out.stride(0), n, BLOCK=block,
        HAS_DELTA=delta is not None, num_warps=4,
    )  # fmt: skip
    return out
