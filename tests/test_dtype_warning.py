"""The startup warning for a dtype that serves far slower than it need (float32 on CUDA)."""

from __future__ import annotations

import torch

from loraplex.config import dtype_warning


def test_float32_on_cuda_is_warned_and_nothing_else() -> None:
    for device in ("cuda", "cuda:1", torch.device("cuda", 0)):
        text = dtype_warning(device, torch.float32)
        assert text is not None and "float32" in text and "bfloat16" in text
    for dtype in (torch.bfloat16, torch.float16):
        assert dtype_warning("cuda", dtype) is None
    assert dtype_warning("cpu", torch.float32) is None
