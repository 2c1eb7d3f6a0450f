"""The GPU's busy fraction over a window of steps: the union of its kernels' execution intervals
(from the profiler's CUDA activity) over the window's wall time. Kernels that overlap (a LoRA op
on a side stream beside its base GEMM) count once; launch gaps count as idle, which event pairs
around steps would not show.

Beside it, where the kernel time goes: each kernel's duration summed by kind (`kernel_kind`: the
base GEMMs, attention, LoRA, the fused norm / rotary / activation kernels, the KV write, and the
rest), as a fraction of the window. Kernels on two streams at once each count their own time, so
the kinds may add up to more than the busy fraction."""

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
        self.by_kind: dict[str, float] = {}  # kernel seconds per kind over the window
        self.top_kernels: list[dict[str, Any]] = []  # the kernels that took the most time

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
        kernels = [
            (e.name, e.time_range.start, e.time_range.end)
            for e in self._prof.events()
            if e.device_type == torch.autograd.DeviceType.CUDA and e.time_range.end > e.time_range.start
        ]
        self._prof = None
        self.kernels = len(kernels)
        intervals = sorted((start, end) for _, start, end in kernels)
        self.fraction = union_length(intervals) * 1e-6 / self.window_s if self.window_s > 0 else None
        self.by_kind, self.top_kernels = time_by_kind(kernels)

    def summary(self) -> dict[str, Any]:
        """The window as `bench serve` reports it (`gpu_busy`)."""
        return {
            "fraction": self.fraction,
            "window_s": self.window_s,
            "kernels": self.kernels,
            # kernel time by kind as a fraction of the window (kernels on two streams each count)
            "by_kind": {k: v / self.window_s for k, v in self.by_kind.items()} if self.window_s else {},
            "top_kernels": self.top_kernels,
        }


# Kernel kinds by name (the first match wins). The package's Triton kernels are named by their
# functions; cuBLAS's GEMM kernels by their library's conventions (nvjet, sm90_xmma, cutlass).
KINDS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("attention", ("decode_kernel", "decode_combine_kernel", "prefill_kernel", "mixed_step_kernel")),
    ("lora", ("lora_shrink", "lora_expand")),
    ("kv write", ("kv_write",)),
    ("norm, rotary, activation", ("rmsnorm", "rotary", "silu_mul")),
    ("gemm", ("gemm", "nvjet", "xmma", "cutlass", "cublas", "splitkreduce")),
)


def kernel_kind(name: str) -> str:
    lower = name.lower()
    for kind, needles in KINDS:
        if any(n in lower for n in needles):
            return kind
    return "other"


def time_by_kind(
    kernels: list[tuple[str, float, float]], top: int = 10
) -> tuple[dict[str, float], list[dict[str, Any]]]:
    """(name, start us, end us) records -> (seconds per kind, the `top` kernels by total time)."""
    kinds: dict[str, float] = {}
    names: dict[str, list[float]] = {}
    for name, start, end in kernels:
        seconds = (end - start) * 1e-6
        kind = kernel_kind(name)
        kinds[kind] = kinds.get(kind, 0.0) + seconds
        entry = names.setdefault(name, [0.0, 0])
        entry[0] += seconds
        entry[1] += 1
    ranked = sorted(names.items(), key=lambda kv: -kv[1][0])[:top]
    return kinds, [
        {"name": n[:120], "kind": kernel_kind(n), "seconds": t, "count": int(c)} for n, (t, c) in ranked
    ]


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
