"""The GPU's busy fraction over a window of steps: the union of its kernels' execution intervals
(from the profiler's CUDA activity) over the window's wall time. Kernels that overlap (a LoRA op
on a side stream beside its base GEMM) count once; launch gaps count as idle, which event pairs
around steps would not show."""

from __future__ import annotations

import time
from typing import Any


class BusyWindow:
    """start() ... stop() around the steps to measure; `fraction` afterwards (None off CUDA)."""

    def __init__(self) -> None:
        self._prof: Any = None
        self._t0 = 0.0
        self.fraction: float | None = None
        self.window_s = 0.0
        self.kernels = 0

    @property
    def active(self) -> bool:
        return self._prof is not None

    def start(self) -> None:
        import torch

        if not torch.cuda.is_available():
            return
        from torch.profiler import ProfilerActivity, profile

        torch.cuda.synchronize()
        self._prof = profile(activities=[ProfilerActivity.CUDA])
        self._prof.start()
        self._t0 = time.perf_counter()

    def stop(self) -> None:
        if self._prof is None:
            return
        import torch

        torch.cuda.synchronize()
        self.window_s = time.perf_counter() - self._t0
        self._prof.stop()
        intervals = sorted(
            (e.time_range.start, e.time_range.end)
            for e in self._prof.events()
            if e.device_type == torch.autograd.DeviceType.CUDA and e.time_range.end > e.time_range.start
        )
        self.kernels = len(intervals)
        self._prof = None
        self.fraction = union_length(intervals) * 1e-6 / self.window_s if self.window_s > 0 else None


def union_length(intervals: list[tuple[float, float]]) -> float:
    """Total length covered by sorted (start, end) intervals, overlaps counted once."""
    total = 0.0
    cur_start: float | None = None
    cur_end = 0.0
    for start, end in intervals:
        if cur_start is None or start > cur_end:
            if cur_start is not None:
                total += cur_end - cur_start
            cur_start, cur_end = start, end
        else:
            cur_end = max(cur_end, end)
    if cur_start is not None:
        total += cur_end - cur_start
    return total
