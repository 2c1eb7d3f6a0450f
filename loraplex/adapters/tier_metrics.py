"""What tiered residency measures, kept where it happens (the engine thread) as plain numbers.

Histograms here are fixed buckets and running sums, so `/metrics` (prometheus) and
`GET /admin/v1/residency` render the same observations from one snapshot, taken on the engine
thread; no prometheus object is touched by the engine, and no scrape reads live engine state.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field
from typing import Any

# Seconds: a host-tier load of a small adapter takes well under a millisecond on the CPU, a store
# read of a large one seconds.
LOAD_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
LOAD_TIERS = ("host", "disk")  # where a load onto the device came from
ADMISSION_TIERS = ("device", "host", "disk")  # where a request's adapter was when it was admitted


@dataclass
class Histogram:
    bounds: tuple[float, ...]
    counts: list[int] = field(default_factory=list)  # per bucket, the last one past every bound
    sum: float = 0.0

    def __post_init__(self) -> None:
        self.counts = [0] * (len(self.bounds) + 1)

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.sum += value

    @property
    def count(self) -> int:
        return sum(self.counts)

    def snapshot(self) -> dict[str, Any]:
        """Cumulative counts per upper bound (the last one +Inf), as prometheus exposes them."""
        cumulative, total = [], 0
        for n in self.counts:
            total += n
            cumulative.append(total)
        return {"bounds": list(self.bounds), "cumulative": cumulative, "sum": self.sum, "count": total}


class TierMetrics:
    def __init__(self) -> None:
        self.load_seconds = {t: Histogram(LOAD_BUCKETS) for t in LOAD_TIERS}
        self.ttft_seconds = {t: Histogram(TTFT_BUCKETS) for t in ADMISSION_TIERS}
        self.host_to_device_bytes = 0
        self.stall_seconds = 0.0  # summed over requests: admission until their adapter was resident

    def snapshot(self) -> dict[str, Any]:
        return {
            "host_to_device_bytes": self.host_to_device_bytes,
            "stall_seconds": self.stall_seconds,
            "load_seconds": {t: h.snapshot() for t, h in self.load_seconds.items()},
            "ttft_seconds_by_admission_tier": {t: h.snapshot() for t, h in self.ttft_seconds.items()},
        }
