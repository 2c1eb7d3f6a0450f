"""RMSNorm, computed in float32 and cast back, as the reference models do; on CUDA one fused kernel
(`fused_triton.py`) per call, with the residual add folded in where the layer has one."""

from __future__ import annotations

import torch
from torch import nn

from loraplex.layers.fused import fused_ops, use_fused


def rms_norm_torch(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    dtype = x.dtype
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(dtype)


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(size, dtype=dtype), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if use_fused(x):
            return fused_ops().rmsnorm(x, self.weight, self.eps)
        return rms_norm_torch(x, self.weight, self.eps)

    def forward_add(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(residual + x), residual + x), the sum in the activation dtype. On CUDA one kernel
        that writes the sum into `residual` in place (and returns that tensor)."""
        if use_fused(x):
            return fused_ops().fused_add_rmsnorm(x, residual, self.weight, self.eps), residual
        residual = residual + x
        return rms_norm_torch(residual, self.weight, self.eps), residual
