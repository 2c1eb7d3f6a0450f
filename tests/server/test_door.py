"""The server's door: API keys checked before a body is read (and on /metrics and /openapi.json),
body-size and pending-request limits, /health revealing nothing, and gauges that follow aborts."""

from __future__ import annotations

import re
import socket
import time

import httpx
import pytest
from helpers.live_server import live_server

from loraplex.demo import DEMO_MODEL_DIR
from loraplex.server.limits import MIB, ServerLimits

BASE = "loraplex-demo"
GOOD = {"model": BASE, "prompt": "abc=", "max_tokens": 5, "temperature": 0}
LONG_STREAM = {
    "model": BASE,
    "prompt": "abc=",
    "max_tokens": 58,
    "temperature": 0,
    "ignore_eos": True,
    "stream": True,
}


def _raw_exchange(base_url: str, head: str, timeout: float = 5.0) -> str:
    """Send only a request's head (no body) and read the answer: a server that tried to read the
    body first would time out instead of answering."""
    host, port = base_url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=timeout) as sock:
        sock.sendall(head.encode())
        data = b""
        while b"\r\n\r\n" not in data or not data.split(b"\r\n\r\n", 1)[1].rstrip().endswith(b"}"):
            chunk = sock.recv(65536)
            if not chunk:
                break
            data += chunk
    return data.decode()


def _post_head(path: str, length: int, auth: str | None = None) -> str:
    lines = [
        f"POST {path} HTTP/1.1",
        "Host: x",
        "Content-Type: application/json",
        f"Content-Length: {length}",
    ]
    if auth:
        lines.append(f"Authorization: Bearer {auth}")
    return "\r\n".join(lines) + "\r\n\r\n"


def test_keys_guard_every_route_but_health_before_any_body_is_read() -> None:
    with live_server(str(DEMO_MODEL_DIR), {}, api_keys=("k1",)) as (base, _):
        for path in ("/metrics", "/openapi.json", "/v1/models", "/v1/models/loraplex-demo"):
            resp = httpx.get(base + path)
            assert resp.status_code == 401 and resp.json()["error"]["type"] == "authentication_error", path
            assert httpx.get(base + path, headers={"Authorization": "Bearer k1"}).status_code == 200
        # a malformed body without a key: 401, not 400
        resp = httpx.post(
            base + "/v1/completions", content=b'{"model": ', headers={"content-type": "application/json"}
        )
        assert resp.status_code == 401
        # the head alone gets the 401: the body is never waited for
        answer = _raw_exchange(base, _post_head("/v1/completions", 1000))
        assert answer.startswith("HTTP/1.1 401") and "invalid_api_key" in answer
        answer = _raw_exchange(base, _post_head("/v1/completions", 1000, auth="wrong"))
        assert answer.startswith("HTTP/1.1 401")
        # probes need no key and learn nothing but the state
        health = httpx.get(base + "/health")
        assert health.status_code == 200 and health.json() == {"status": "ok"}
        ok = httpx.post(base + "/v1/completions", json=GOOD, headers={"Authorization": "Bearer k1"})
        assert ok.status_code == 200 and ok.json()["choices"][0]["text"] == "abc"


def test_body_size_limit_declared_and_chunked() -> None:
    limits = ServerLimits(max_body_bytes=64 * 1024)
    with live_server(str(DEMO_MODEL_DIR), {}, limits=limits) as (base, _):
        # declared over the limit: refused from the head alone
        answer = _raw_exchange(base, _post_head("/v1/completions", 3 * MIB))
        assert answer.startswith("HTTP/1.1 413") and '"request_too_large"' in answer
        # chunked (no Content-Length): counted as it arrives
        filler = b'{"model": "loraplex-demo", "prompt": "abc=", "user": "' + b"x" * (200 * 1024) + b'"}'

        def chunks():  # noqa: ANN202
            for i in range(0, len(filler), 8192):
                yield filler[i : i + 8192]

        try:
            resp = httpx.post(
                base + "/v1/completions", content=chunks(), headers={"content-type": "application/json"}
            )
            assert resp.status_code == 413, resp.text
            assert resp.json()["error"]["code"] == "request_too_large"
        except httpx.WriteError:  # the server may close before the client has sent everything
            pass
        # just under the limit: served (unknown fields are ignored)
        under = {**GOOD, "user": "x" * (60 * 1024)}
        resp = httpx.post(base + "/v1/completions", json=under)
        assert resp.status_code == 200 and resp.json()["choices"][0]["text"] == "abc"
        over = {**GOOD, "user": "x" * (70 * 1024)}
        resp = httpx.post(base + "/v1/completions", json=over)
        assert resp.status_code == 413 and resp.json()["error"]["message"]


def test_pending_requests_limit_is_a_429_with_retry_after() -> None:
    with live_server(str(DEMO_MODEL_DIR), {}, limits=ServerLimits(max_pending_requests=2)) as (base, _):
        host, port = base.removeprefix("http://").split(":")
        # two clients that sent a head and are still sending their bodies are pending
        slow = [socket.create_connection((host, int(port)), timeout=5) for _ in range(2)]
        for sock in slow:
            sock.sendall(_post_head("/v1/completions", 1000).encode())
        time.sleep(0.3)
        busy = httpx.post(base + "/v1/completions", json=GOOD)
        assert busy.status_code == 429 and int(busy.headers["retry-after"]) >= 1
        assert busy.json()["error"]["type"] == "rate_limit_error"
        assert httpx.get(base + "/v1/models").status_code == 200  # only generation is counted
        for sock in slow:
            sock.close()
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            resp = httpx.post(base + "/v1/completions", json=GOOD)
            if resp.status_code != 429:
                break
            time.sleep(0.05)
        assert resp.status_code == 200 and resp.json()["choices"][0]["text"] == "abc"


def _metrics(base: str) -> str:
    return httpx.get(base + "/metrics").text


def _gauge(base: str, name: str) -> float:
    return float(re.search(rf"^{name} (\S+)$", _metrics(base), re.M).group(1))


def test_gauges_follow_a_disconnect_on_an_idle_server() -> None:
    with live_server(str(DEMO_MODEL_DIR), {}) as (base, srv):
        engine = srv.async_engine.engine
        with httpx.stream("POST", base + "/v1/completions", json=LONG_STREAM, timeout=60) as resp:
            for line in resp.iter_lines():
                if line.startswith("data: "):
                    break  # gone after the first chunk
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and engine.scheduler.running:
            time.sleep(0.05)
        time.sleep(0.3)
        # it was cut short, so the last step's gauges saw it running
        assert re.search(
            r'^loraplex_requests_finished_total\{.*reason="abort".*\} 1\.0$', _metrics(base), re.M
        )
        assert _gauge(base, "loraplex_engine_steps_total") < 58
        # no other request has arrived since: the abort itself refreshed the gauges
        assert _gauge(base, "loraplex_requests_running") == 0
        assert _gauge(base, "loraplex_kv_cache_usage_ratio") == 0


@pytest.mark.parametrize("bad", [{"max_body_bytes": 0}, {"max_pending_requests": -1}, {"max_logprobs": 2.5}])
def test_limits_validate_themselves(bad: dict) -> None:
    with pytest.raises(ValueError, match=next(iter(bad))):
        ServerLimits(**bad)
    with pytest.raises(ValueError, match="max_body_byte"):
        ServerLimits.from_mapping({"max_body_byte": 5})


def test_key_table_holds_hashes_and_names_the_principal() -> None:
    from loraplex.server.auth import ANONYMOUS, KeyTable, token_hash

    keys = KeyTable.from_tokens(["k1", "k2"])
    assert keys.authenticate("Bearer k2") is not None and keys.authenticate("bearer  k1 ").tenant == "default"
    for bad in ("", "Bearer", "Bearer k3", "Basic k1", "k1", "Bearer \ud800"):
        assert keys.authenticate(bad) is None, bad
    assert "k1" not in repr(keys.__dict__) and token_hash("k1") in keys.__dict__["_by_hash"]
    assert KeyTable().authenticate("") is ANONYMOUS  # no keys configured: open, default tenant


def test_tenant_quotas_use_the_same_status_codes() -> None:
    from loraplex.server.errors import APIError
    from loraplex.server.limits import TenantQuotas

    quotas = TenantQuotas.from_mapping({"max_adapters": 2, "max_rank": 16, "max_adapter_bytes": 1000})
    quotas.check_registration("acme", adapters_after=2, rank=16, bytes_after=1000)  # at the quotas: fine
    for kwargs, status in (
        ({"adapters_after": 3, "rank": 8, "bytes_after": 10}, 403),
        ({"adapters_after": 1, "rank": 32, "bytes_after": 10}, 403),
        ({"adapters_after": 1, "rank": 8, "bytes_after": 1001}, 413),
    ):
        with pytest.raises(APIError) as refused:
            quotas.check_registration("acme", **kwargs)
        assert refused.value.status == status and "acme" in refused.value.message
    busy = TenantQuotas(max_concurrent_requests=4)
    busy.check_concurrency("acme", 3)
    with pytest.raises(APIError) as refused:
        busy.check_concurrency("acme", 4)
    assert refused.value.status == 429 and refused.value.headers == {"Retry-After": "1"}
    TenantQuotas().check_registration("acme", 10**6, 10**6, 10**12)  # no quotas: nothing refused
    with pytest.raises(ValueError, match="max_adaptors"):
        TenantQuotas.from_mapping({"max_adaptors": 1})
    with pytest.raises(ValueError, match="max_rank"):
        TenantQuotas(max_rank=0)
