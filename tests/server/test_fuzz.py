"""Fuzzing the HTTP surface of one live server (the demo model and its four adapters).

Whatever a client sends, the answer is never a 5xx: an error is a 4xx with OpenAI's error JSON,
a success is strict JSON (no NaN or Infinity) or a complete event stream, and the server keeps
serving good requests correctly afterwards.

The examples are fixed (derandomized, no example database) so every run sends the same requests.
Shrinking is off: a failing example is reported as drawn, with the request in the message, and
the run stays within its time budget however many examples would fail.
"""

from __future__ import annotations

import http.client
import itertools
import json
import math
from collections.abc import Iterator
from typing import Any
from urllib.parse import urlsplit

import httpx
import pytest
from helpers.fuzz_strategies import (
    CONTENT_TYPES,
    GET_PATHS,
    JSON_VALUES,
    MIB,
    POST_PATHS,
    RAW_BODIES,
    dumps,
    requests,
)
from helpers.live_server import live_server
from hypothesis import HealthCheck, Phase, example, given, settings
from hypothesis import strategies as st

from loraplex.demo import DEMO_ADAPTERS, DEMO_MODEL_DIR

CHECK_EVERY = 25  # examples between two checks that the server still serves a good request


def fuzz_settings(max_examples: int) -> settings:
    return settings(
        max_examples=max_examples,
        deadline=None,
        derandomize=True,
        database=None,
        phases=(Phase.explicit, Phase.generate),
        suppress_health_check=list(HealthCheck),
        print_blob=False,
    )


# --- the server and the checks of every answer ---------------------------------------------------


@pytest.fixture(scope="module")
def server():  # noqa: ANN201
    adapters = {name: str(path) for name, path in DEMO_ADAPTERS.items()}
    with live_server(str(DEMO_MODEL_DIR), adapters) as (base_url, srv):
        yield base_url, srv


@pytest.fixture(scope="module")
def client(server) -> Iterator[httpx.Client]:  # noqa: ANN001
    # no keep-alive: a connection the server dropped after one request cannot fail the next
    with httpx.Client(
        base_url=server[0], timeout=60, limits=httpx.Limits(max_keepalive_connections=0)
    ) as client:
        yield client


def _refuse_constant(name: str) -> Any:  # noqa: ANN401
    raise ValueError(f"it holds {name}")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"it holds the number {text}")
    return value


def strict_json(text: str) -> Any:
    """json.loads that fails on NaN, Infinity, -Infinity and on numbers such as 1e999."""
    return json.loads(text, parse_constant=_refuse_constant, parse_float=_finite_float)


def check_error_body(status: int, text: str, what: str) -> None:
    try:
        body = strict_json(text)
    except ValueError as err:
        raise AssertionError(f"{what}: the {status} body is not JSON ({err}): {text[:300]!r}") from None
    assert isinstance(body, dict) and isinstance(body.get("error"), dict), (what, status, text[:300])
    err = body["error"]
    assert isinstance(err.get("message"), str), (what, status, text[:300])
    assert {"message", "type", "param", "code"} <= set(err), (what, status, text[:300])


def check_event_stream(text: str, what: str) -> None:
    events = [line[len("data:") :].strip() for line in text.splitlines() if line.startswith("data:")]
    assert events and events[-1] == "[DONE]", (what, text[-300:])
    for data in events[:-1]:
        try:
            strict_json(data)
        except ValueError as err:
            raise AssertionError(f"{what}: a stream event is not JSON ({err}): {data[:300]!r}") from None


def check_answer(status: int, content_type: str, text: str, what: str) -> None:
    assert status < 500, f"{what}: answered {status}: {text[:500]!r}"
    if status >= 400:
        check_error_body(status, text, what)
    elif content_type.startswith("text/event-stream"):
        check_event_stream(text, what)
    elif content_type.startswith("application/json"):
        try:
            strict_json(text)
        except ValueError as err:
            raise AssertionError(f"{what}: the {status} body is not strict JSON ({err})") from None


def _chunks(raw: bytes) -> Iterator[bytes]:
    size = 65_536
    for i in range(0, len(raw), size):
        yield raw[i : i + size]


def post(
    client: httpx.Client, path: str, raw: bytes, headers: dict[str, str], chunked: bool = False
) -> tuple[int, str]:
    """POST `raw` (chunked: without Content-Length), check the answer, reading a stream to its
    end, and return its status and text."""
    what = f"POST {path} {headers}{' chunked' if chunked else ''} {raw[:300]!r}"
    try:
        content = _chunks(raw) if chunked else raw
        with client.stream("POST", path, content=content, headers=headers) as resp:
            status, kind = resp.status_code, resp.headers.get("content-type", "")
            text = resp.read().decode("utf-8", errors="replace")
    except httpx.TransportError as err:  # e.g. the server dropped the connection
        raise AssertionError(f"{what}: no complete answer: {err!r}") from None
    check_answer(status, kind, text, what)
    if status < 400:
        assert kind.startswith(("application/json", "text/event-stream")), (what, kind)
    return status, text


_calls = itertools.count(1)


def check_still_serving(base_url: str, srv: Any) -> None:  # noqa: ANN401
    good = {"model": "reverse", "prompt": "hello=", "max_tokens": 20, "temperature": 0}
    r = httpx.post(base_url + "/v1/completions", json=good, timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == "olleh"
    assert httpx.get(base_url + "/health", timeout=30).status_code == 200
    assert srv.async_engine.alive, f"the engine thread is gone: {srv.async_engine.error!r}"


def counted(server) -> None:  # noqa: ANN001
    if next(_calls) % CHECK_EVERY == 0:
        check_still_serving(*server)


# --- the fuzz tests ------------------------------------------------------------------------------


@fuzz_settings(max_examples=1000)
@given(request=requests())
def test_request_like_bodies(server, client: httpx.Client, request: tuple[str, Any]) -> None:  # noqa: ANN001
    path, body = request
    post(client, path, dumps(body), {"content-type": "application/json"})
    counted(server)


@fuzz_settings(max_examples=200)
@given(path=st.sampled_from(POST_PATHS), body=JSON_VALUES)
def test_any_json_value(server, client: httpx.Client, path: str, body: Any) -> None:  # noqa: ANN001, ANN401
    post(client, path, dumps(body), {"content-type": "application/json"})
    counted(server)


@fuzz_settings(max_examples=400)
@given(path=st.sampled_from(POST_PATHS), raw=RAW_BODIES, content_type=CONTENT_TYPES, chunked=st.booleans())
@example(path="/v1/completions", raw=b"[" * 100_000, content_type="application/json", chunked=False)
@example(path="/v1/completions", raw=b"a" * (3 * MIB), content_type="application/json", chunked=True)
@example(path="/v1/chat/completions", raw=b"{" * (3 * MIB), content_type="application/json", chunked=True)
def test_raw_bodies(
    server, client: httpx.Client, path: str, raw: bytes, content_type: str, chunked: bool
) -> None:  # noqa: ANN001
    headers = {"content-type": content_type} if content_type else {}
    post(client, path, raw, headers, chunked)
    counted(server)


@fuzz_settings(max_examples=300)
@given(target=GET_PATHS)
def test_get_paths(server, target: str) -> None:  # noqa: ANN001
    # HTTPConnection sends the request target as given (httpx would normalize dot segments and escapes)
    what = f"GET {target[:300]!r}"
    where = urlsplit(server[0])
    conn = http.client.HTTPConnection(where.hostname, where.port, timeout=60)
    try:
        conn.request("GET", target, headers={"accept": "*/*"})
        resp = conn.getresponse()
        status, kind = resp.status, resp.getheader("content-type") or ""
        text = resp.read().decode("utf-8", errors="replace")
    except (OSError, http.client.HTTPException) as err:
        raise AssertionError(f"{what}: no complete answer: {err!r}") from None
    finally:
        conn.close()
    check_answer(status, kind, text, what)
    counted(server)


def test_server_still_serves_after_fuzzing(server) -> None:  # noqa: ANN001
    check_still_serving(*server)
