"""The per-request metrics without a server: label caps, the deadline hook, a tenant's view."""

from __future__ import annotations

import re
from types import SimpleNamespace

import pytest

from loraplex.server.async_engine import RequestTimes
from loraplex.server.metrics import ServerMetrics
from loraplex.server.request_metrics import OTHER, LabelCap, deadline_of
from loraplex.types import AdapterRef, RequestOutput, SamplingParams


def test_a_cap_hands_out_sticky_slots_to_values_with_enough_requests() -> None:
    cap = LabelCap(2, min_requests=3)
    assert [cap.admit("rare") for _ in range(2)] == [OTHER, OTHER]
    assert [cap.admit("hot") for _ in range(3)] == [OTHER, OTHER, "hot"]
    assert cap.admit("rare") == "rare"  # its third request
    assert [cap.admit("late") for _ in range(5)] == [OTHER] * 5  # full, for good
    assert cap.admit("hot") == "hot" and cap.labelled == {"hot", "rare"}
    assert LabelCap(0).admit("x") == OTHER
    for bad in ((-1, 1), (1, 0)):
        with pytest.raises(ValueError):
            LabelCap(*bad)


def _request(
    metrics: ServerMetrics, adapter: str | None, tenant: str, deadline_s: float | None = None
) -> None:
    """One request through the observer: admitted at t=0, scheduled at 0.1, first token at 0.5."""
    ref = None if adapter is None else AdapterRef(adapter, "ab" * 32)
    out = RequestOutput("r", [1, 2, 3], ref, token_ids=[4, 5], finish_reason="length")
    times = RequestTimes(0.0, tenant, ref, deadline_s=deadline_s)
    metrics.on_admitted(out, times)
    times.scheduled = 0.1
    metrics.on_scheduled(times)
    times.first_token = 0.5
    metrics.on_first_token(times)
    metrics.on_finished(out, times, 0.05)


def _value(text: str, series: str) -> float:
    m = re.search(rf"^{re.escape(series)} (\S+)$", text, re.M)
    return float(m.group(1)) if m else 0.0


def test_tenants_are_capped_deadlines_counted_and_a_tenant_sees_only_itself() -> None:
    metrics = ServerMetrics(max_adapters=1, max_tenants=2)
    for i, tenant in enumerate(("acme", "globex", "initech", "umbrella")):
        _request(metrics, "a" if i % 2 else None, tenant, deadline_s=0.2 if i < 3 else 1.0)
    _request(metrics, "b", "acme")
    text = metrics.render().decode()
    assert set(re.findall(r'^loraplex_tenant_requests_total\{tenant="([^"]+)"', text, re.M)) == {
        "acme",
        "globex",
        OTHER,
    }
    assert _value(text, f'loraplex_tenant_requests_total{{tenant="{OTHER}"}}') == 2
    assert _value(text, 'loraplex_requests_total{adapter="b",revision=""}') == 0
    assert _value(text, f'loraplex_requests_total{{adapter="{OTHER}",revision=""}}') == 1  # "b"
    assert _value(text, 'loraplex_queue_time_seconds_count{adapter="a",revision="abababababab"}') == 2
    # A first token 0.5 s after arrival misses a 0.2 s deadline, not a 1 s one; no deadline, no count.
    assert _value(text, f'loraplex_tenant_deadline_misses_total{{tenant="{OTHER}"}}') == 1
    assert _value(text, f'loraplex_tenant_requests_with_deadline_total{{tenant="{OTHER}"}}') == 2
    assert _value(text, 'loraplex_tenant_deadline_misses_total{tenant="acme"}') == 1
    assert _value(text, 'loraplex_tenant_requests_with_deadline_total{tenant="acme"}') == 1
    assert _value(text, 'loraplex_deadline_misses_total{adapter="base",revision=""}') == 2

    view = metrics.render({"a"}, "acme").decode()
    assert 'tenant="acme"' in view and 'adapter="a"' in view and 'adapter="base"' in view
    assert "globex" not in view and OTHER not in view


def test_the_deadline_hook_reads_the_sequence_then_its_params() -> None:
    params = SamplingParams()
    assert deadline_of(SimpleNamespace(params=params)) is None
    assert deadline_of(SimpleNamespace(params=params, deadline_s=2)) == 2.0
    on_params = SimpleNamespace(params=SimpleNamespace(deadline_s=0.5))
    assert deadline_of(on_params) == 0.5


def test_the_engine_puts_the_asked_deadline_where_the_metrics_read_it() -> None:
    from loraplex.config import EngineConfig
    from loraplex.demo import DEMO_MODEL_DIR
    from loraplex.engine.engine import Engine

    engine = Engine(EngineConfig(model_dir=str(DEMO_MODEL_DIR)))
    engine.add_request("d", "hello=", SamplingParams(max_tokens=2), deadline_s=0.25)
    engine.add_request("n", "hello=", SamplingParams(max_tokens=2))
    assert deadline_of(engine.sequence("d")) == 0.25
    assert deadline_of(engine.sequence("n")) is None
