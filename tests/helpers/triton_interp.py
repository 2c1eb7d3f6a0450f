"""Imported by kernel test modules before any kernel module: where there is no CUDA, switch
Triton to its interpreter (`@triton.jit` reads TRITON_INTERPRET when the kernels are defined, and
the switch is process-wide, so it is only set where no GPU test can see it)."""

from __future__ import annotations

import os

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ["TRITON_INTERPRET"] = "1"

try:
    import triton  # noqa: F401  (after TRITON_INTERPRET is set above)

    HAS_TRITON = True
except ImportError:
    HAS_TRITON = False

needs_interp = pytest.mark.skipif(
    HAS_CUDA or not HAS_TRITON, reason="needs triton and no CUDA (the interpreter is process-wide)"
)
