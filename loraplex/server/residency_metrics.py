"""The residency measurements that are histograms or counters in `/metrics`: load latency per
source tier, time to first token by the tier the adapter was in at admission, host -> device
bytes, hits per tier, evictions, load failures, stalled requests and their stall time. Loads onto
the device are the load histogram's counts (per source tier), so they have no series of their own.
The tiers' levels (adapters and bytes held, budgets) are gauges in `metrics.py`.

The engine keeps them as plain numbers (`adapters/tier_metrics.py`); `ServerMetrics` hands this
collector a snapshot of `AdapterTiers.stats()` taken on the engine thread whenever residency
changed, and a scrape renders the latest snapshot (it never reads live engine state).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector


class ResidencyCollector(Collector):
    def __init__(self) -> None:
        self.stats: dict[str, Any] | None = None  # replaced whole (one assignment) by the engine thread

    def collect(self) -> Iterator[Metric]:
        stats = self.stats
        if stats is None:
            return
        yield _histogram(
            "loraplex_adapter_load_seconds",
            "Adapter loads onto the device, from the start of the load until the adapter is usable by "
            "a step (waiting for room included), by the tier it came from",
            stats["load_seconds"],
        )
        yield _histogram(
            "loraplex_adapter_time_to_first_token_seconds",
            "Engine admission to first token of adapter requests, by the tier their adapter was in at "
            "admission (device hit, host hit, disk miss)",
            stats["ttft_seconds_by_admission_tier"],
        )
        hits = CounterMetricFamily(
            "loraplex_adapter_admissions",
            "Adapter requests admitted, by the tier their adapter was in",
            labels=["tier"],
        )
        hits.add_metric(["device"], stats["device"]["hits"])
        hits.add_metric(["host"], stats["host_admissions"])
        hits.add_metric(["disk"], stats["disk"]["hits"])
        yield hits
        for name, doc, value in (
            (
                "loraplex_adapter_host_to_device_bytes",
                "Adapter bytes copied onto the device",
                "host_to_device_bytes",
            ),
            ("loraplex_adapter_evictions", "Adapters evicted from the device", "evictions"),
            (
                "loraplex_adapter_load_failures",
                "Adapter loads that failed (a store read or conversion; the requests waiting got an error)",
                "load_failures",
            ),
            (
                "loraplex_adapter_stalled_requests",
                "Requests admitted while their adapter was off the device (they waited for its load)",
                "stalled_requests",
            ),
            (
                "loraplex_adapter_stall_seconds",
                "Seconds requests waited for their adapter's load, summed over requests",
                "stall_seconds",
            ),
        ):
            yield CounterMetricFamily(name, doc, value=stats[value])


def _histogram(name: str, doc: str, by_tier: dict[str, dict[str, Any]]) -> HistogramMetricFamily:
    family = HistogramMetricFamily(name, doc, labels=["tier"])
    for tier, h in by_tier.items():
        bounds = [*(repr(float(b)) for b in h["bounds"]), "+Inf"]
        family.add_metric([tier], list(zip(bounds, h["cumulative"], strict=True)), h["sum"])
    return family
