"""GPU timing with CUDA events: median of many runs, L2 flushed before each, eager or graph replay;
and the two ceilings every kernel number is quoted against (copy bandwidth, bf16 matrix rate)."""

from __future__ import annotations

import statistics
from collections.abc import Callable

import torch

L2_FLUSH_BYTES = 512 << 20  # several times the H200's 60 MB L2


class GpuTimer:
    def __init__(self, device: torch.device, reps: int = 40, warmup: int = 5) -> None:
        self.device = device
        self.reps = reps
        self.warmup = warmup
        self._flush = torch.ones(L2_FLUSH_BYTES // 4, dtype=torch.int32, device=device)

    def flush_l2(self) -> None:
        # Read, not write: a written flush leaves L2 full of dirty lines whose write-back would be
        # charged to the timed kernel.
        self._flush.max()

    def capture(self, fn: Callable[[], object]) -> torch.cuda.CUDAGraph:
        """A CUDA graph of fn, after one run outside the capture (compile and fill caches)."""
        fn()
        torch.cuda.synchronize(self.device)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
        return graph

    def median_ms(self, fn: Callable[[], object]) -> float:
        """Median of `reps` event-timed runs of fn, each after reading a buffer larger than L2."""
        for _ in range(self.warmup):
            fn()
        starts = [torch.cuda.Event(enable_timing=True) for _ in range(self.reps)]
        ends = [torch.cuda.Event(enable_timing=True) for _ in range(self.reps)]
        for s, e in zip(starts, ends, strict=True):
            self.flush_l2()
            s.record()
            fn()
            e.record()
        torch.cuda.synchronize(self.device)
        return statistics.median(s.elapsed_time(e) for s, e in zip(starts, ends, strict=True))

    def graph_median_ms(self, fn: Callable[[], object]) -> float:
        """Same, for the replay of a CUDA graph captured from fn (launch gaps mostly gone)."""
        graph = self.capture(fn)
        ms = self.median_ms(graph.replay)
        del graph
        return ms


def copy_bandwidth(timer: GpuTimer, gib: int = 4) -> float:
    """Bytes/s of a device-to-device copy of `gib` GiB, counting bytes read plus bytes written."""
    n = (gib << 30) // 2
    src = torch.empty(n, dtype=torch.bfloat16, device=timer.device).normal_()
    dst = torch.empty_like(src)
    ms = timer.median_ms(lambda: dst.copy_(src))
    return 2 * (gib << 30) / (ms * 1e-3)


def matmul_rate(timer: GpuTimer, n: int = 8192) -> float:
    """FLOP/s of an n x n x n bf16 matrix product on random data (never zeros: they run faster)."""
    a = torch.randn(n, n, device=timer.device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=timer.device, dtype=torch.bfloat16)
    ms = timer.median_ms(lambda: a @ b)
    return 2 * n**3 / (ms * 1e-3)
