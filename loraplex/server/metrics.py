"""Prometheus metrics, labelled by adapter name and revision (`base` for the base model).

Each server owns its own registry, so several servers in one process (tests) never collide.
"""

from __future__ import annotations

import re
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
from loraplex.server.async_engine import StepObserver
from loraplex.server.residency_metrics import ResidencyCollector
from loraplex.types import AdapterRef, RequestOutput

disable_created_metrics()  # the *_created series only add noise to every counter

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
_ADAPTER_BUCKETS = (0, 1, 2, 3, 4, 8, 16, 32, 64, 128)


_ADAPTER_LABEL = re.compile(rb'[{,]adapter="([^"]*)"')


def _labels(adapter: AdapterRef | None) -> tuple[str, str]:
    return ("base", "") if adapter is None else (adapter.name, adapter.revision[:12])


class ServerMetrics(StepObserver):
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        by_adapter = ["adapter", "revision"]
        r = self.registry
        self.requests = Counter("loraplex_requests", "Requests admitted", by_adapter, registry=r)
        self.finished = Counter(
            "loraplex_requests_finished", "Requests finished", [*by_adapter, "reason"], registry=r
        )
        self.prompt_tokens = Counter(
            "loraplex_prompt_tokens", "Prompt tokens admitted", by_adapter, registry=r
        )
        self.generation_tokens = Counter(
            "loraplex_generation_tokens", "Tokens generated", by_adapter, registry=r
        )
        self.ttft = Histogram(
            "loraplex_time_to_first_token_seconds",
            "Admission to first token",
            by_adapter,
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.tpot = Histogram(
            "loraplex_time_per_output_token_seconds",
            "Mean time between output tokens of a request",
            by_adapter,
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.running = Gauge("loraplex_requests_running", "Requests being computed", registry=r)
        self.waiting = Gauge("loraplex_requests_waiting", "Requests waiting for admission", registry=r)
        self.kv_usage = Gauge("loraplex_kv_cache_usage_ratio", "Fraction of KV blocks in use", registry=r)
        self.step_adapters = Histogram(
            "loraplex_step_distinct_adapters",
            "Distinct adapter revisions per engine step",
            buckets=_ADAPTER_BUCKETS,
            registry=r,
        )
        self.max_step_adapters = Gauge(
            "loraplex_step_distinct_adapters_max",
            "Most distinct adapter revisions seen in one step",
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
        self.preemptions = Counter("loraplex_preemptions", "Sequences preempted for KV space", registry=r)
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

    # --- StepObserver (called on the engine thread) ---------------------------------------------

    def on_admitted(self, out: RequestOutput) -> None:
        labels = _labels(out.adapter)
        self.requests.labels(*labels).inc()
        self.prompt_tokens.labels(*labels).inc(len(out.prompt_token_ids))

    def on_first_token(self, adapter: AdapterRef | None, seconds: float) -> None:
        self.ttft.labels(*_labels(adapter)).observe(seconds)

    def on_finished(self, out: RequestOutput, seconds_per_output_token: float | None) -> None:
        labels = _labels(out.adapter)
        self.finished.labels(*labels, out.finish_reason or "unknown").inc()
        self.generation_tokens.labels(*labels).inc(len(out.token_ids))
        if seconds_per_output_token is not None:
            self.tpot.labels(*labels).observe(seconds_per_output_token)

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
        self.step_adapters.observe(stats.num_lora_segments)
        if stats.num_lora_segments > self._max_adapters:
            self._max_adapters = stats.num_lora_segments
            self.max_step_adapters.set(stats.num_lora_segments)
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

    def render(self, adapters: set[str] | None = None) -> bytes:
        """The text exposition; with `adapters`, only the per-adapter series of those names (and
        the base model's): a tenant's view, which names no other tenant's private adapter."""
        text = generate_latest(self.registry)
        if adapters is None:
            return text
        allowed = {b"base", *(a.encode() for a in adapters)}
        kept = [
            line
            for line in text.split(b"\n")
            if (m := _ADAPTER_LABEL.search(line)) is None or m.group(1) in allowed
        ]
        return b"\n".join(kept)
