"""Rotary position embeddings (default, linear and llama3 frequency scaling), half-rotation layout."""

from __future__ import annotations

import math

import torch
from torch import nn

from loraplex.config import RopeConfig
from loraplex.layers.fused import fused_ops, use_fused
from loraplex.layers.norm import RMSNorm


def rope_inv_freq(rope: RopeConfig, head_dim: int) -> torch.Tensor:
    """Inverse frequencies [head_dim // 2], float32, with the configured scaling applied."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    inv_freq = 1.0 / (rope.theta**exponents)
    if rope.rope_type == "linear":
        return inv_freq / rope.factor
    if rope.rope_type == "llama3":
        return _llama3_scale(inv_freq, rope)
    return inv_freq


def _llama3_scale(inv_freq: torch.Tensor, rope: RopeConfig) -> torch.Tensor:
    # Long wavelengths are divided by `factor`, short ones kept, and the band between blended
    # linearly in 1/wavelength (Llama 3.1's context extension).
    old_len = rope.original_max_position_embeddings
    low_wavelen = old_len / rope.low_freq_factor
    high_wavelen = old_len / rope.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / rope.factor, inv_freq)
    smooth = (old_len / wavelen - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor)
    blended = (1 - smooth) * scaled / rope.factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return torch.where(medium, blended, scaled)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rope_torch(
    positions: torch.Tensor, inv_freq: torch.Tensor, q: torch.Tensor, k: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference: positions [T], q [T, Hq, D], k [T, Hkv, D] -> new rotated (q, k), cos/sin
    recomputed in float32 and rounded to the activation dtype as transformers does."""
    freqs = positions.float()[:, None] * inv_freq[None, :]  # [T, D/2], float32
    emb = torch.cat((freqs, freqs), dim=-1)
    cos = emb.cos().to(q.dtype)[:, None, :]
    sin = emb.sin().to(q.dtype)[:, None, :]
    return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


class RotaryEmbedding(nn.Module):
    """Applies RoPE to q and k. On CUDA one fused kernel per layer reads cos/sin from a table
    built once per device (`cos_sin_cache`) and rotates q and k in place; elsewhere the torch code
    recomputes them per call. Both give the same float32 cos/sin values: the table's rows are the
    same `position * inv_freq` products through the same cos/sin."""

    inv_freq: torch.Tensor  # a buffer (not saved: recomputed from the config)

    def __init__(self, rope: RopeConfig, head_dim: int, max_positions: int = 0) -> None:
        super().__init__()
        self.register_buffer("inv_freq", rope_inv_freq(rope, head_dim), persistent=False)
        self.max_positions = max_positions
        self._cos_sin: torch.Tensor | None = None  # [n, head_dim] float32: cos | sin of position p

    def cos_sin_cache(self, min_positions: int = 0) -> torch.Tensor:
        """The table for positions < max(max_positions, min_positions), on inv_freq's device.

        Built on first use and rebuilt only when it is too short or on another device, so build
        it (run one eager step) before capturing a CUDA graph: a rebuild inside a capture would
        record the table's computation instead of running it.
        """
        table = self._cos_sin
        dev = self.inv_freq.device
        if table is not None and table.device == dev and table.shape[0] >= min_positions:
            return table
        if dev.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(
                f"RoPE table for {min_positions} positions built inside a CUDA graph capture; "
                "run an eager forward with the same bound (or call cos_sin_cache) before capturing"
            )
        # beyond max_positions grow to a power of two, so a context growing a token per step
        # rebuilds the table O(log n) times, not every step
        n = max(self.max_positions, 1 << max(min_positions - 1, 0).bit_length())
        # int64 -> float32 like `positions.float()` in the torch path, so the products are equal
        freqs = torch.arange(n, dtype=torch.int64, device=dev).float()[:, None] * self.inv_freq[None, :]
        self._cos_sin = torch.cat((freqs.cos(), freqs.sin()), dim=-1)
        return self._cos_sin

    def forward(
        self,
        positions: torch.Tensor,
        q: torch.Tensor,
        k: torch.Tensor,
        max_position: int = 0,
        q_norm: RMSNorm | None = None,
        k_norm: RMSNorm | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """positions: [T]; q: [T, Hq, D]; k: [T, Hkv, D] -> rotated (q, k). max_position: a host
        bound on the positions (every position < it; 0 if they stay below max_positions).
        q_norm / k_norm (Qwen3) are applied per head first. On CUDA q and k are rotated in place
        and returned."""
        if use_fused(q):
            table = self.cos_sin_cache(max_position)
            qn = (q_norm.weight, q_norm.eps) if q_norm is not None else None
            kn = (k_norm.weight, k_norm.eps) if k_norm is not None else None
            fused_ops().rotary_qk_(q, k, positions, table, qn, kn)
            return q, k
        if q_norm is not None and k_norm is not None:
            q, k = q_norm(q), k_norm(k)
        return rope_torch(positions, self.inv_freq, q, k)
