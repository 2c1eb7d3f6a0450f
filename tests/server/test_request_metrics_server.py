"""Per-adapter and per-tenant request metrics, per-step series, the label cap, and OpenAI's
`usage.prompt_tokens_details.cached_tokens`, on a live server over the demo model (context 64
tokens, KV blocks of 16: a prompt of 47 characters has 2 full blocks a repeat can hit)."""

from __future__ import annotations

import json
import re
import uuid

import httpx
import pytest
from helpers.live_server import live_server

from loraplex.demo import DEMO_ADAPTERS, DEMO_MODEL_DIR

BASE = "loraplex-demo"
PROMPT = "the quick brown fox jumps over the lazy dog and"  # 47 characters: 32 tokens can hit


@pytest.fixture(scope="module")
def server():  # noqa: ANN201
    adapters = {name: str(path) for name, path in DEMO_ADAPTERS.items()}
    # One adapter name gets series of its own; the demo's other three share `_other`.
    with live_server(str(DEMO_MODEL_DIR), adapters, settings_kw={"metrics_max_adapters": 1}) as live:
        yield live


@pytest.fixture(scope="module")
def base_url(server) -> str:  # noqa: ANN001
    return server[0]


def _metrics(server) -> str:  # noqa: ANN001
    """Every series, as an admin key sees them (the open data plane's callers see a tenant's view)."""
    return server[1].metrics.render().decode()


def _value(text: str, series: str) -> float:
    """One sample's value (`series`: the name with its labels, as exposed), 0 when absent."""
    m = re.search(rf"^{re.escape(series)} (\S+)$", text, re.M)
    return float(m.group(1)) if m else 0.0


def _complete(url: str, **body: object) -> dict:
    r = httpx.post(url + "/v1/completions", json={"max_tokens": 3, "temperature": 0, **body}, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def test_series_move_with_requests_and_adapter_labels_are_capped(server) -> None:  # noqa: ANN001
    base_url = server[0]
    before = _metrics(server)
    for model in (BASE, "reverse", "upper", "sort", "caesar"):
        _complete(base_url, model=model, prompt="abc=")
    text = _metrics(server)
    labelled = re.findall(r'^loraplex_requests_total\{adapter="([^"]+)"', text, re.M)
    # The base is never capped; of the four adapters exactly one took the one slot.
    assert "base" in labelled and "_other" in labelled and len(labelled) == 3, labelled
    assert _value(text, 'loraplex_requests_total{adapter="_other",revision=""}') >= 3
    for family in ("time_to_first_token_seconds", "queue_time_seconds"):
        assert _value(text, f'loraplex_{family}_count{{adapter="_other",revision=""}}') >= 3
        grew = _value(text, f'loraplex_tenant_{family}_count{{tenant="default"}}') - _value(
            before, f'loraplex_tenant_{family}_count{{tenant="default"}}'
        )
        assert grew == 5, family  # the open data plane's one tenant
    tpot = 'loraplex_tenant_time_per_output_token_seconds_count{tenant="default"}'
    assert _value(text, tpot) - _value(before, tpot) == 5
    # Per step: every step observed its segments, its distinct models and its occupancy.
    steps = _value(text, "loraplex_engine_steps_total")
    for family in ("lora_segments", "distinct_adapters", "batch_occupancy_ratio"):
        assert _value(text, f"loraplex_step_{family}_count") == steps > 0, family
    occupancy = _value(text, "loraplex_step_batch_occupancy_ratio_sum")
    assert 0 < occupancy <= steps  # rows / budget is a fraction
    assert _value(text, "loraplex_step_lora_segments_sum") >= 4  # each adapter ran in some step
    # No request here carries a deadline: the deadline series exist in the text only once one does.
    assert "loraplex_deadline_misses_total{" not in text
    # A tenant's view (here the open data plane's): its own tenant, never `_other`, which sums
    # adapters and tenants it may not see.
    view = httpx.get(base_url + "/metrics").text
    assert 'tenant="default"' in view and 'adapter="base"' in view and "_other" not in view


def _cached(usage: dict) -> int:
    return usage["prompt_tokens_details"]["cached_tokens"]


def test_usage_reports_cached_tokens(base_url: str) -> None:
    salt = uuid.uuid4().hex  # this test's own prefix-cache entries, whatever ran before
    body = {"model": "reverse", "prompt": PROMPT, "cache_salt": salt}
    assert _cached(_complete(base_url, **body)["usage"]) == 0  # a miss
    assert _cached(_complete(base_url, **body)["usage"]) == 32  # two full blocks of 16
    short = _complete(base_url, model="reverse", prompt="abc=", cache_salt=salt)["usage"]
    assert _cached(short) == 0  # no full block to hit

    chat = {"model": "reverse", "messages": [{"role": "user", "content": PROMPT}], "max_tokens": 2}
    chat["cache_salt"] = salt + "-chat"  # (the demo's chat template starts with the message itself)
    first = httpx.post(base_url + "/v1/chat/completions", json=chat, timeout=60).json()["usage"]
    again = httpx.post(base_url + "/v1/chat/completions", json=chat, timeout=60).json()["usage"]
    assert _cached(first) == 0 and 0 < _cached(again) < again["prompt_tokens"]

    stream = {**body, "max_tokens": 3, "stream": True, "stream_options": {"include_usage": True}}
    with httpx.stream("POST", base_url + "/v1/completions", json=stream, timeout=60) as r:
        lines = [line[6:] for line in r.iter_lines() if line.startswith("data: ") and line != "data: [DONE]"]
    usage = json.loads(lines[-1])["usage"]
    assert _cached(usage) == 32 and usage["prompt_tokens"] == len(PROMPT)
