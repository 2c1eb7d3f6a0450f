"""The one place that decides whether the decoder layer's elementwise work runs on the fused
Triton kernels (`fused_triton.py`): for CUDA tensors, unless LORAPLEX_FUSED_OPS=0 (an escape hatch
for A/B timing and for bisecting numerics on the GPU). Everywhere else the torch code runs, and
triton is never imported.
"""

from __future__ import annotations

import os
from types import ModuleType

import torch

ENABLED = os.environ.get("LORAPLEX_FUSED_OPS", "1") != "0"
_ops: ModuleType | None = None


def use_fused(x: torch.Tensor) -> bool:
    return ENABLED and x.is_cuda


def fused_ops() -> ModuleType:
    """`loraplex.layers.fused_triton`, imported on first use (kept, as this is called per layer)."""
    global _ops
    if _ops is None:
        from loraplex.layers import fused_triton

        _ops = fused_triton
    return _ops
