"""Host lists to device tensors without stalling the host.

`torch.tensor(values, device="cuda")` (or a copy from ordinary host memory) waits until the copy
is done, which waits for all work queued before it on the stream: the host then cannot prepare
the next launches while the GPU runs. Through pinned memory the copy is queued like a kernel and
the host goes on; PyTorch's pinned-memory cache keeps the host buffer until the copy has run.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

# Lists convert through numpy: 3-4x faster than torch.tensor(list) at every size measured (4 to
# 8192 ints), which matters for an eager step's per-token lists (ids, positions, KV slots).
_NUMPY_DTYPES = {torch.int64: np.int64, torch.int32: np.int32, torch.float32: np.float32}


def to_device(
    values: Sequence[int] | Sequence[float], dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    device = torch.device(device)
    np_dtype = _NUMPY_DTYPES.get(dtype)
    if np_dtype is None:
        host = torch.tensor(values, dtype=dtype)
    else:
        host = torch.from_numpy(np.array(values, dtype=np_dtype))
    if device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)
