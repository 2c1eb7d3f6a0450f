"""`loraplex serve` as a user starts it, API keys, and `loraplex adapters list`."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
from helpers.live_server import free_port, live_server

from loraplex.demo import DEMO_ADAPTERS, DEMO_MODEL_DIR


def test_serve_with_no_arguments_serves_the_demo(tmp_path: Path) -> None:
    port = free_port()
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "loraplex.cli", "serve", "--port", str(port)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
    )
    try:
        base = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                if httpx.get(base + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.1)
        ids = {m["id"] for m in httpx.get(base + "/v1/models").json()["data"]}
        assert ids == {"loraplex-demo", *DEMO_ADAPTERS}
        out = httpx.post(
            base + "/v1/completions", json={"model": "reverse", "prompt": "abc=", "temperature": 0}
        )
        assert out.json()["choices"][0]["text"] == "cba"
        listing = subprocess.run(
            [sys.executable, "-m", "loraplex.cli", "adapters", "list", "--url", base],
            capture_output=True,
            text=True,
            check=True,
        )
        assert "reverse" in listing.stdout and "loraplex-demo\tbase" in listing.stdout
    finally:
        proc.terminate()
        log, _ = proc.communicate(timeout=20)
    assert f"127.0.0.1:{port}" in log, log
    assert all(name in log for name in DEMO_ADAPTERS), log


def test_api_keys_are_enforced_when_configured(monkeypatch) -> None:  # noqa: ANN001
    monkeypatch.setenv("LORAPLEX_API_KEYS", "k1,k2")
    with live_server(str(DEMO_MODEL_DIR), {}) as (base, _):
        body = {"model": "loraplex-demo", "prompt": "abc=", "temperature": 0}
        assert httpx.post(base + "/v1/completions", json=body).status_code == 401
        bad = httpx.post(base + "/v1/completions", json=body, headers={"Authorization": "Bearer nope"})
        assert bad.status_code == 401 and bad.json()["error"]["type"] == "authentication_error"
        ok = httpx.post(base + "/v1/completions", json=body, headers={"Authorization": "Bearer k2"})
        assert ok.status_code == 200 and ok.json()["choices"][0]["text"] == "abc"
        assert httpx.get(base + "/health").status_code == 200  # probes need no key
