"""A real `loraplex serve` process over a data directory, stopped and started again: what the admin
API registered (adapters, an alias, a tenant, its key, a retirement) is all still there and served,
though the adapter's source is gone; and the offline CLI refuses to write while it runs."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
from helpers.admin_server import ADMIN, admin, complete, create_key, sources, text
from helpers.live_server import free_port


@contextmanager
def _serve(data: Path, root: Path) -> Iterator[str]:
    port = free_port()
    env = {**os.environ, "LORAPLEX_ADMIN_KEY": ADMIN, "PYTHONUNBUFFERED": "1"}
    cmd = [sys.executable, "-m", "loraplex.cli", "serve", "--port", str(port), "--data-dir", str(data)]
    proc = subprocess.Popen(
        [*cmd, "--allow-source-root", str(root)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
    )
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 90
        while True:
            assert proc.poll() is None, proc.communicate()[0]
            assert time.monotonic() < deadline, "the server did not start"
            try:
                if httpx.get(base + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.1)
        yield base
    finally:
        proc.terminate()
        proc.communicate(timeout=30)


def test_restart_keeps_and_serves_everything(tmp_path: Path) -> None:
    root = sources(tmp_path / "sources")
    data = tmp_path / "data"
    with _serve(data, root) as base:
        body = {"name": "flip", "source": str(root / "reverse"), "visibility": "shared"}
        reg = admin("POST", base, "/adapters", json=body)
        assert reg.status_code == 201, reg.text
        revision = reg.json()["revision"]
        gone = admin("POST", base, "/adapters", json={"name": "gone", "source": str(root / "sort")})
        assert admin("DELETE", base, f"/adapters/gone@{gone.json()['revision']}").status_code == 200
        assert (
            admin("PUT", base, "/aliases/flip/stable", json={"target": f"flip@{revision}"}).status_code == 200
        )
        assert admin("POST", base, "/tenants", json={"name": "acme"}).status_code == 201
        key = create_key(base, "acme")
        assert text(complete(base, key, "flip")) == "cba"
        offline = subprocess.run(
            [sys.executable, "-m", "loraplex.cli", "tenants", "create", "x", "--data-dir", str(data)],
            capture_output=True,
            text=True,
        )
        assert offline.returncode != 0 and "--url" in offline.stderr, offline.stderr
    shutil.rmtree(root / "reverse")  # the source is gone: the store serves it
    with _serve(data, root) as base:
        assert text(complete(base, key, "flip")) == "cba"  # the tenant's key survived
        assert text(complete(base, key, "flip/stable")) == "cba"
        assert text(complete(base, key, f"flip@{revision[:8]}")) == "cba"
        assert complete(base, key, "gone").status_code == 404  # private to the default tenant
        retired = complete(base, ADMIN, "gone")
        assert retired.status_code == 404 and "retired" in retired.text
        assert admin("GET", base, "/adapters/gone").json()["revisions"][0]["state"] == "retired"
        names = {
            m["id"]
            for m in httpx.get(f"{base}/v1/models", headers={"Authorization": f"Bearer {key}"}).json()["data"]
        }
        assert {"flip", "reverse", "upper"} <= names and "gone" not in names
