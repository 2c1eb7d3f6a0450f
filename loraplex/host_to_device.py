"""Host lists to device tensors without stalling the host.

`torch.tensor(values, device="cuda")` (or a copy from ordinary host memory) waits until the copy
is done, which waits for all work queued before it on the stream: the host then cannot prepare
the next launches while the GPU runs. Through pinned memory the copy is queued like a kernel and
the host goes on; PyTorch's pinned-memory cache keeps the host buffer until the copy has run.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def to_device(
    values: Sequence[int] | Sequence[float], dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    device = torch.device(device)
    if device.type != "cuda":
        return torch.tensor(values, dtype=dtype, device=device)
    return torch.tensor(values, dtype=dtype, pin_memory=True).to(device, non_blocking=True)
