"""Prometheus metrics: per request by adapter (name and revision, `base` for the base model) and
by tenant, with capped label values (`request_metrics.py`); per engine step; prefix cache,
residency tiers and the rest as levels and totals.

Each server owns its own registry, so several servers in one process (tests) never collide.
"""

from __future__ import annotations

import re
import time
from typing import Any

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
    generate_latest,
)

from loraplex.engine.engine import Engine
from loraplex.server.async_engine import RequestTimes, StepObserver
from loraplex.server.request_metrics import RequestMetrics
from loraplex.server.residency_metrics import ResidencyCollector
from loraplex.types import RequestOutput

disable_created_metrics()  # the *_created series only add noise to every counter

_ADAPTER_BUCKETS = (0, 1, 2, 3, 4, 8, 16, 32, 64, 128)
_OCCUPANCY_BUCKETS = (0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 1.0)

# Which lines of the exposition name an adapter, or a tenant (a tenant's view filters on both).
_ADAPTER_LABEL = re.compile(rb'[{,]adapter="([^"]*)"')
_TENANT_LABEL = re.compile(rb'[{,]tenant="([^"]*)"')


class ServerMetrics(StepObserver):
    """`max_adapters`, `max_tenants`, `min_requests`: the label caps of the per-request series
    (`request_metrics.py`)."""

    def __init__(self, max_adapters: int = 64, max_tenants: int = 64, min_requests: int = 1) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        # The per-request series, by adapter and by tenant, their label values capped.
        self.per_request = RequestMetrics(r, max_adapters, max_tenants, min_requests)
        self.running = Gauge("loraplex_requests_running", "Requests being computed", registry=r)
        self.waiting = Gauge("loraplex_requests_waiting", "Requests waiting for admission", registry=r)
        self.kv_usage = Gauge("loraplex_kv_cache_usage_ratio", "Fraction of KV blocks in use", registry=r)
        self.step_segments = Histogram(
            "loraplex_step_lora_segments",
            "LoRA segments the step's LoRA ops ran (one per adapter slot among its rows)",
            buckets=_ADAPTER_BUCKETS,
            registry=r,
        )
        self.step_adapters = Histogram(
            "loraplex_step_distinct_adapters",
            "Distinct models among a step's rows: adapter revisions, and the base model as one",
            buckets=_ADAPTER_BUCKETS,
            registry=r,
        )
        self.max_step_adapters = Gauge(
            "loraplex_step_distinct_adapters_max",
            "Most distinct models (adapter revisions, the base as one) seen in one step",
            registry=r,
        )
        self.step_occupancy = Histogram(
            "loraplex_step_batch_occupancy_ratio",
            "A step's token rows / the step token budget (max_num_batched_tokens)",
            buckets=_OCCUPANCY_BUCKETS,
            registry=r,
        )
        self.steps = Counter("loraplex_engine_steps", "Engine steps run", registry=r)
        by_unit = ["unit"]  # tokens | blocks
        self.prefix_queries = Counter(
            "loraplex_prefix_cache_queries",
            "Known tokens / full blocks of the sequences admitted while the prefix cache is on",
            by_unit,
            registry=r,
        )
        self.prefix_hits = Counter(
            "loraplex_prefix_cache_hits",
            "Of those, tokens / blocks whose K/V came from the prefix cache",
            by_unit,
            registry=r,
        )
        self.prefix_hit_rate = Gauge(
            "loraplex_prefix_cache_hit_rate", "Prefix-cache hits / queries since startup", by_unit, registry=r
        )
        self.prefix_cached_blocks = Gauge(
            "loraplex_prefix_cache_blocks", "KV blocks the prefix cache knows (held or not)", registry=r
        )
        self.prefix_evictions = Counter(
            "loraplex_prefix_cache_evictions", "Cached KV blocks whose room was taken back", registry=r
        )
        self.preemptions = Counter(
            "loraplex_preemptions",
            "Sequences preempted: for KV space, or for a slot taken by a tenant under its share",
            registry=r,
        )
        self.graph_replays = Counter(
            "loraplex_cuda_graph_replays", "Decode steps run as CUDA-graph replays", registry=r
        )
        self.graph_captures = Gauge(
            "loraplex_cuda_graphs_captured", "CUDA graphs captured (one per new decode shape)", registry=r
        )
        self.kernel_compiles = Gauge(
            "loraplex_kernel_compiles",
            "Triton kernel specializations compiled in this process (flat after startup: a rise is a "
            "compile on the serving path)",
            registry=r,
        )
        self.warmup_seconds = Gauge(
            "loraplex_startup_warmup_seconds",
            "Seconds the engine spent capturing decode graphs at startup",
            registry=r,
        )
        self.refused = Counter(
            "loraplex_requests_refused",
            "HTTP requests refused before reaching the engine",
            ["status"],
            registry=r,
        )
        by_tier = ["tier"]
        self.tier_adapters = Gauge(
            "loraplex_adapter_tier_adapters", "Adapters held per tier", by_tier, registry=r
        )
        self.tier_bytes = Gauge(
            "loraplex_adapter_tier_bytes", "Bytes used per adapter tier", by_tier, registry=r
        )
        self.tier_budget = Gauge(
            "loraplex_adapter_tier_budget_bytes", "Byte budget per adapter tier", by_tier, registry=r
        )
        # The tiers' running totals are counters and histograms there, one series per number;
        # the gauges above are only levels (what is held now, and the budgets).
        self.residency = ResidencyCollector()
        r.register(self.residency)
        self._max_adapters = 0
        self._tier_events = -1
        self._prefix_seen = (0, 0, 0, 0, 0, 0)  # the prefix cache's numbers last exported
        self._step_budget = 0  # the engine's step token budget, read at its first step

    # --- StepObserver (called on the engine thread) ---------------------------------------------

    def on_admitted(self, out: RequestOutput, times: RequestTimes) -> None:
        times.labels = self.per_request.labels_of(out.adapter, times.tenant)
        self.per_request.admitted(times.labels, out)

    def on_scheduled(self, times: RequestTimes) -> None:
        assert times.scheduled is not None
        self.per_request.observe(self.per_request.queue_time, times.labels, times.scheduled - times.arrival)

    def on_first_token(self, times: RequestTimes) -> None:
        assert times.first_token is not None
        self.per_request.observe(self.per_request.ttft, times.labels, times.first_token - times.arrival)

    def on_finished(
        self, out: RequestOutput, times: RequestTimes, seconds_per_output_token: float | None
    ) -> None:
        missed = None
        if times.deadline_s is not None:
            # A request that never got a first token missed it when it ended past its deadline.
            end = times.first_token if times.first_token is not None else time.monotonic()
            missed = end - times.arrival > times.deadline_s
        self.per_request.finished_request(times.labels, out, seconds_per_output_token, missed)

    def on_gauges(self, engine: Engine) -> None:
        self.running.set(len(engine.scheduler.running))
        self.waiting.set(len(engine.scheduler.waiting))
        self.kv_usage.set(engine.pool.num_used / engine.pool.num_blocks)

    def on_step(self, engine: Engine) -> None:
        stats = engine.last_stats
        self.on_gauges(engine)
        if stats is None:
            return
        self.steps.inc()
        self.step_segments.observe(stats.num_lora_segments)
        distinct = stats.num_lora_segments + (stats.num_base_rows > 0)
        self.step_adapters.observe(distinct)
        if distinct > self._max_adapters:
            self._max_adapters = distinct
            self.max_step_adapters.set(distinct)
        self.step_occupancy.observe(stats.num_rows / self._budget(engine))
        if stats.preempted:
            self.preemptions.inc(len(stats.preempted))
        if stats.static_replay and engine.graph_replays:
            self.graph_replays.inc()
        self.graph_captures.set(engine.graph_captures)
        self.kernel_compiles.set(engine.kernel_compiles)
        self.warmup_seconds.set(engine.warmup_s)
        if engine.tiers.events != self._tier_events:  # only when residency changed: cheap per step
            self._tier_events = engine.tiers.events
            self._on_tiers(engine.tiers.stats())
        if engine.prefix_cache is not None:
            self._on_prefix_cache(engine)

    def _budget(self, engine: Engine) -> int:
        if not self._step_budget:
            self._step_budget = engine.config.scheduler.step_token_budget
        return self._step_budget

    def _on_prefix_cache(self, engine: Engine) -> None:
        """Export the prefix cache's numbers when they moved (admissions, commits, evictions)."""
        assert engine.prefix_cache is not None
        s, pool = engine.prefix_cache.stats, engine.pool
        now = (s.query_tokens, s.hit_tokens, s.query_blocks, s.hit_blocks, pool.evictions, pool.num_cached)
        last = self._prefix_seen
        if now == last:
            return
        self._prefix_seen = now
        self.prefix_queries.labels("tokens").inc(now[0] - last[0])
        self.prefix_hits.labels("tokens").inc(now[1] - last[1])
        self.prefix_queries.labels("blocks").inc(now[2] - last[2])
        self.prefix_hits.labels("blocks").inc(now[3] - last[3])
        self.prefix_evictions.inc(now[4] - last[4])
        self.prefix_hit_rate.labels("tokens").set(s.token_hit_rate)
        self.prefix_hit_rate.labels("blocks").set(s.block_hit_rate)
        self.prefix_cached_blocks.set(pool.num_cached)

    def _on_tiers(self, stats: dict[str, Any]) -> None:
        self.residency.stats = (
            stats  # a fresh dict from `AdapterTiers.stats()`: the engine keeps no reference
        )
        device, host = stats["device"], stats["host"]
        for tier, adapters, used, budget in (
            ("device", device["adapters"], device["allocated_bytes"], device["budget_bytes"]),
            ("host", host["adapters"], host["used_bytes"], host["budget_bytes"]),
        ):
            self.tier_adapters.labels(tier).set(adapters)
            self.tier_bytes.labels(tier).set(used)
            self.tier_budget.labels(tier).set(budget)

    def render(self, adapters: set[str] | None = None, tenant: str | None = None) -> bytes:
        """The text exposition; with `adapters`, a tenant's view: only the per-adapter series of
        those names (and the base model's), and only `tenant`'s per-tenant series, so it names no
        other tenant's private adapter nor another tenant. `_other` is left out of it too: it
        sums adapters and tenants the caller may not see."""
        text = generate_latest(self.registry)
        if adapters is None:
            return text
        allowed = {b"base", *(a.encode() for a in adapters)}
        own = (tenant or "").encode()
        kept = [
            line
            for line in text.split(b"\n")
            if ((m := _ADAPTER_LABEL.search(line)) is None or m.group(1) in allowed)
            and ((t := _TENANT_LABEL.search(line)) is None or t.group(1) == own)
        ]
        return b"\n".join(kept)
