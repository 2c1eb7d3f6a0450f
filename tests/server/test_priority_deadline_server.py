"""`priority` and `deadline_ms` on the completions and chat endpoints, over real HTTP to a live server
on the demo model under the adaptive policy: accepted values reach the engine's sequences, bad ones
are a 400 naming the field (and reach nothing), and a deadline no request can meet shows in the
deadline-miss series of /metrics."""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from helpers.live_server import live_server

from loraplex.demo import DEMO_ADAPTERS, DEMO_MODEL_DIR
from loraplex.server.serve import Server

ROUTES = {
    "/v1/completions": {"prompt": "abc="},
    "/v1/chat/completions": {"messages": [{"role": "user", "content": "abc"}]},
}


@pytest.fixture(scope="module")
def server() -> Iterator[tuple[str, Server]]:
    adapters = {name: str(path) for name, path in DEMO_ADAPTERS.items()}
    with live_server(str(DEMO_MODEL_DIR), adapters, policy="adaptive") as live:
        yield live


@pytest.fixture
def admitted(server: tuple[str, Server], monkeypatch: pytest.MonkeyPatch) -> list[dict[str, Any]]:
    """What each request the engine admits carries on its sequence, recorded as it is admitted."""
    engine = server[1].async_engine.engine
    original = engine.add_request
    seen: list[dict[str, Any]] = []

    def add_request(request_id: str, *args: Any, **kwargs: Any) -> None:  # noqa: ANN401
        original(request_id, *args, **kwargs)
        seq = engine.sequence(request_id)
        due = None if seq.deadline is None else seq.deadline - engine.scheduler.clock()
        seen.append({"priority": seq.priority, "deadline_s": seq.deadline_s, "due_in": due})

    monkeypatch.setattr(engine, "add_request", add_request)
    return seen


def _post(url: str, route: str, **fields: Any) -> httpx.Response:  # noqa: ANN401
    body = {"model": "reverse", "max_tokens": 2, "temperature": 0, **ROUTES[route], **fields}
    return httpx.post(url + route, json=body, timeout=60)


@pytest.mark.parametrize("route", list(ROUTES))
def test_priority_and_deadline_reach_every_choice(
    server: tuple[str, Server], admitted: list[dict[str, Any]], route: str
) -> None:
    r = _post(server[0], route, priority=-7, deadline_ms=250, n=2)
    assert r.status_code == 200, r.text
    assert [a["priority"] for a in admitted] == [-7, -7]
    assert [a["deadline_s"] for a in admitted] == [0.25, 0.25]
    assert all(0.2 < a["due_in"] <= 0.25 for a in admitted)  # due 250 ms after its admission
    admitted.clear()
    r = _post(server[0], route, priority=1000, deadline_ms=0.5)  # the bounds, and a fraction of a ms
    assert r.status_code == 200, r.text
    assert admitted[0]["priority"] == 1000 and admitted[0]["deadline_s"] == 0.0005
    admitted.clear()
    assert _post(server[0], route).status_code == 200  # neither given: priority 0, no deadline
    assert admitted == [{"priority": 0, "deadline_s": None, "due_in": None}]


@pytest.mark.parametrize("route", list(ROUTES))
@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("priority", 1001),
        ("priority", -1001),
        ("priority", 1.5),
        ("priority", "3"),
        ("priority", True),
        ("priority", None),
        ("deadline_ms", 0),
        ("deadline_ms", -20),
        ("deadline_ms", 3_600_001),
        ("deadline_ms", "100"),
        ("deadline_ms", True),
        ("deadline_ms", [100]),
    ],
)
def test_a_bad_value_is_a_400_naming_the_field(
    server: tuple[str, Server], admitted: list[dict[str, Any]], route: str, field: str, value: object
) -> None:
    r = _post(server[0], route, **{field: value})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == field and field in error["message"], error
    assert admitted == []  # refused before the engine


def _total(text: str, family: str) -> float:
    """The sum of a counter family's samples (every adapter, or every tenant)."""
    return sum(float(v) for v in re.findall(rf"^{family}_total\{{[^}}]*\}} (\S+)$", text, re.M))


def test_an_impossible_deadline_is_counted_as_missed(server: tuple[str, Server]) -> None:
    base_url, srv = server
    before = srv.metrics.render().decode()
    # 1 microsecond: no first token comes that fast. An hour: every first token does.
    for route, deadline_ms in (("/v1/completions", 0.001), ("/v1/chat/completions", 0.001)):
        assert _post(base_url, route, deadline_ms=deadline_ms).status_code == 200
    assert _post(base_url, "/v1/completions", deadline_ms=3_600_000).status_code == 200
    assert _post(base_url, "/v1/completions").status_code == 200  # no deadline: in neither series
    after = srv.metrics.render().decode()
    for prefix in ("loraplex", "loraplex_tenant"):
        grew = {
            family: _total(after, f"{prefix}_{family}") - _total(before, f"{prefix}_{family}")
            for family in ("requests_with_deadline", "deadline_misses")
        }
        assert grew == {"requests_with_deadline": 3, "deadline_misses": 2}, (prefix, grew)
    # A tenant's own view (the open data plane's one tenant) shows its misses too.
    view = httpx.get(base_url + "/metrics", timeout=60).text
    assert _total(view, "loraplex_tenant_deadline_misses") >= 2
