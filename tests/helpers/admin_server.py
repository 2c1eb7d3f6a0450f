"""A live server with an admin key and an allow-listed source root, and small HTTP helpers for the
admin API tests."""

from __future__ import annotations

import shutil
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
from safetensors import safe_open

from helpers.live_server import live_server
from loraplex.demo import DEMO_ADAPTERS, DEMO_MODEL_DIR
from loraplex.server.serve import Server

ADMIN = "admin-secret-for-tests"
MODEL = str(DEMO_MODEL_DIR)
BASE = "loraplex-demo"


def sources(root: Path) -> Path:
    """Copies of the demo adapters under `root` (the allow-listed source root)."""
    for name, path in DEMO_ADAPTERS.items():
        shutil.copytree(path, root / name)
    return root


@contextmanager
def admin_server(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, **engine_kw: Any
) -> Iterator[tuple[str, Server, Path]]:
    """A demo server with LORAPLEX_ADMIN_KEY set; yields (base url, server, source root)."""
    monkeypatch.setenv("LORAPLEX_ADMIN_KEY", ADMIN)
    root = sources(tmp_path / "sources")
    demo = {k: str(v) for k, v in DEMO_ADAPTERS.items()}
    with live_server(MODEL, demo, source_roots=(str(root),), **engine_kw) as (base, server):
        yield base, server, root


def auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def admin(method: str, base: str, path: str, key: str = ADMIN, **kw: Any) -> httpx.Response:
    return httpx.request(method, f"{base}/admin/v1{path}", headers=auth(key), timeout=60, **kw)


def create_key(base: str, tenant: str, role: str = "data") -> str:
    out = admin("POST", base, "/keys", json={"role": role, "tenant": tenant, "label": f"{tenant}-{role}"})
    assert out.status_code == 201, out.text
    return str(out.json()["token"])


def complete(base: str, key: str, model: str, prompt: str = "abc=", **extra: Any) -> httpx.Response:
    body = {"model": model, "prompt": prompt, "temperature": 0, "max_tokens": 16, **extra}
    return httpx.post(base + "/v1/completions", json=body, headers=auth(key), timeout=60)


def text(response: httpx.Response) -> str:
    assert response.status_code == 200, response.text
    return str(response.json()["choices"][0]["text"])


@contextmanager
def demo_traffic(base: str, threads: int = 2) -> Iterator[list[str]]:
    """Generation requests on the demo's adapters and base model, nonstop while the block runs;
    yields the list of wrong answers (checked after the block: it should stay empty)."""
    expected = {"reverse": "cba", "upper": "ABC", BASE: None}
    wrong: list[str] = []
    stop = threading.Event()
    done = [0]

    def run() -> None:
        while not stop.is_set() or done[0] < 3:  # at least a few answers, however fast the block
            for model, want in expected.items():
                got = complete(base, ADMIN, model)
                if got.status_code != 200 or (want is not None and text(got) != want):
                    wrong.append(f"{model}: {got.text}")
                done[0] += 1

    workers = [threading.Thread(target=run) for _ in range(threads)]
    for w in workers:
        w.start()
    try:
        yield wrong
    finally:
        stop.set()
        for w in workers:
            w.join()


def demo_footprint(path: Path) -> int:
    """Device bytes of a demo adapter in the float32 pool: each tensor rounded up to 16 bytes."""
    total = 0
    with safe_open(str(path / "adapter_model.safetensors"), framework="pt") as f:
        for name in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
            total += -(-f.get_tensor(name).numel() * 4 // 16) * 16
    return total
