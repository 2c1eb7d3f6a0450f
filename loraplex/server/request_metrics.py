"""Per-request Prometheus series, by adapter and by tenant, with a bound on their label values.

A server may hold thousands of adapters (and tenants); a series per name and histogram bucket
would make every scrape, and the Prometheus behind it, pay for all of them. So each label has a
cap (`LabelCap`): the first `limit` values to reach `min_requests` admitted requests get a label of
their own, for good; every other value is counted under `_other` (no adapter or tenant name can
start with `_`). Slots are sticky, never handed back: a value that lost its slot would make its
series vanish and `_other` jump, which Prometheus reads as counter resets. With `min_requests`
above 1 the slots go to the adapters that send traffic first and often, the hot ones under a
skewed popularity, while a long tail of rare adapters stays in `_other`.

Adapter series carry `adapter` (its name, `base` for the base model; `base` is never capped) and
`revision` (the first 12 hex digits; empty for `_other`); tenant series carry `tenant`. The two
families are separate, never their product.
"""

from __future__ import annotations

from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Histogram

from loraplex.engine.sequence import Sequence
from loraplex.types import AdapterRef, RequestOutput

OTHER = "_other"
NO_TENANT = "_none"  # a request admitted without a tenant (an engine driven in process)

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class LabelCap:
    """Which values of one label get a series of their own (see the module docstring)."""

    def __init__(self, limit: int, min_requests: int = 1) -> None:
        if limit < 0:
            raise ValueError(f"a metrics label limit must be >= 0, got {limit}")
        if min_requests < 1:
            raise ValueError(f"metrics min_requests must be >= 1, got {min_requests}")
        self.limit = limit
        self.min_requests = min_requests
        self.labelled: set[str] = set()
        self._counts: dict[str, int] = {}  # admissions of values not labelled yet

    def admit(self, value: str) -> str:
        """The label of one admitted request with `value` (counting it toward a slot)."""
        if value in self.labelled:
            return value
        if len(self.labelled) >= self.limit:
            return OTHER
        n = self._counts.get(value, 0) + 1
        if n < self.min_requests:
            self._counts[value] = n
            return OTHER
        self._counts.pop(value, None)
        self.labelled.add(value)
        if len(self.labelled) >= self.limit:
            self._counts.clear()  # full for good: nothing counted here can take a slot any more
        return value


@dataclass(frozen=True)
class RequestLabels:
    """One request's label values, fixed at its admission (a slot taken later changes nothing)."""

    adapter: tuple[str, str]  # (adapter, revision)
    tenant: str


def deadline_of(seq: Sequence) -> float | None:
    """The request's time-to-first-token deadline in seconds after arrival, if it has one.

    A request counts toward the deadline series when its sequence (or its sampling parameters)
    carries `deadline_s`, with the simulator's meaning (`bench/workloads.py`): the first token is
    due that many seconds after arrival. `Engine.add_request(deadline_s=...)` sets it; on a server,
    the request body's `deadline_ms`.
    """
    for holder in (seq, seq.params):
        value = getattr(holder, "deadline_s", None)
        if value is not None:
            return float(value)
    return None


class RequestMetrics:
    """The series, each family twice: by adapter (`[0]`) and by tenant (`[1]`, `loraplex_tenant_*`)."""

    def __init__(
        self,
        registry: CollectorRegistry,
        max_adapters: int = 64,
        max_tenants: int = 64,
        min_requests: int = 1,
    ) -> None:
        self.adapters = LabelCap(max_adapters, min_requests)
        self.tenants = LabelCap(max_tenants, min_requests)
        by_adapter, by_tenant = ["adapter", "revision"], ["tenant"]

        def counters(name: str, doc: str, extra: tuple[str, ...] = ()) -> tuple[Counter, Counter]:
            return (
                Counter(f"loraplex_{name}", doc, [*by_adapter, *extra], registry=registry),
                Counter(f"loraplex_tenant_{name}", doc, [*by_tenant, *extra], registry=registry),
            )

        def histograms(name: str, doc: str) -> tuple[Histogram, Histogram]:
            return (
                Histogram(f"loraplex_{name}", doc, by_adapter, buckets=LATENCY_BUCKETS, registry=registry),
                Histogram(
                    f"loraplex_tenant_{name}", doc, by_tenant, buckets=LATENCY_BUCKETS, registry=registry
                ),
            )

        self.requests = counters("requests", "Requests admitted")
        self.finished = counters("requests_finished", "Requests finished", ("reason",))
        self.prompt_tokens = counters("prompt_tokens", "Prompt tokens admitted")
        self.generation_tokens = counters("generation_tokens", "Tokens generated")
        self.ttft = histograms("time_to_first_token_seconds", "Admission to first token")
        self.tpot = histograms(
            "time_per_output_token_seconds", "Mean time between output tokens of a request"
        )
        self.queue_time = histograms(
            "queue_time_seconds", "Admission to the start of the first engine step that computed its rows"
        )
        self.with_deadline = counters("requests_with_deadline", "Finished requests that had a deadline")
        self.deadline_misses = counters(
            "deadline_misses", "Finished requests whose first token came after their deadline (or never)"
        )

    def labels_of(self, adapter: AdapterRef | None, tenant: str | None) -> RequestLabels:
        """Called once per admitted request: its label values, counted toward the caps."""
        if adapter is None:
            by_adapter = ("base", "")
        else:
            name = self.adapters.admit(adapter.name)
            by_adapter = (name, "" if name == OTHER else adapter.revision[:12])
        return RequestLabels(by_adapter, self.tenants.admit(tenant if tenant is not None else NO_TENANT))

    def admitted(self, labels: RequestLabels, out: RequestOutput) -> None:
        _count(self.requests, labels)
        _count(self.prompt_tokens, labels, len(out.prompt_token_ids))

    def observe(self, pair: tuple[Histogram, Histogram], labels: RequestLabels, seconds: float) -> None:
        pair[0].labels(*labels.adapter).observe(seconds)
        pair[1].labels(labels.tenant).observe(seconds)

    def finished_request(
        self, labels: RequestLabels, out: RequestOutput, tpot: float | None, deadline_missed: bool | None
    ) -> None:
        """`deadline_missed`: None when the request had no deadline."""
        reason = out.finish_reason or "unknown"
        self.finished[0].labels(*labels.adapter, reason).inc()
        self.finished[1].labels(labels.tenant, reason).inc()
        _count(self.generation_tokens, labels, len(out.token_ids))
        if tpot is not None:
            self.observe(self.tpot, labels, tpot)
        if deadline_missed is not None:
            _count(self.with_deadline, labels)
            if deadline_missed:
                _count(self.deadline_misses, labels)


def _count(pair: tuple[Counter, Counter], labels: RequestLabels, amount: float = 1) -> None:
    pair[0].labels(*labels.adapter).inc(amount)
    pair[1].labels(labels.tenant).inc(amount)
