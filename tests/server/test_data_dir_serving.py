"""`serve` over a data directory: startup adapters go through the control plane (idempotent on
restart), every registered revision is served from the store (its source may be gone), and one
server at a time holds the directory."""

from __future__ import annotations

import shutil
from pathlib import Path

import httpx
import pytest
from helpers.live_server import live_server

from loraplex.adapters.data_dir import DataDirLockedError
from loraplex.adapters.registry_db import RegistryDB, adapters
from loraplex.config import EngineConfig
from loraplex.demo import DEMO_ADAPTERS, DEMO_MODEL_DIR
from loraplex.server.serve import ServerSettings, build_server

MODEL = str(DEMO_MODEL_DIR)


def _complete(base: str, model: str, prompt: str) -> str:
    body = {"model": model, "prompt": prompt, "temperature": 0, "max_tokens": 16}
    out = httpx.post(base + "/v1/completions", json=body, timeout=60)
    assert out.status_code == 200, out.text
    return str(out.json()["choices"][0]["text"])


def test_restart_serves_registered_adapters_without_their_source(tmp_path: Path) -> None:
    source = tmp_path / "src" / "flip"
    shutil.copytree(DEMO_ADAPTERS["reverse"], source)
    data = tmp_path / "data"
    with live_server(MODEL, {"flip": str(source)}, data_dir=str(data)) as (base, server):
        first = _complete(base, "flip", "abc=")
        revision = server.async_engine.engine.adapters.latest("flip").revision
    assert first == "cba"
    with live_server(MODEL, {"flip": str(source)}, data_dir=str(data)) as (base, server):
        assert server.async_engine.engine.adapters.latest("flip").revision == revision  # idempotent
    db = RegistryDB.in_dir(str(data))
    assert db.count(adapters) == 1
    assert [r["result"] for r in db.audit() if r["action"] == "register"] == ["ok", "exists"]
    db.close()
    shutil.rmtree(source)  # the source is gone: the store serves it
    with live_server(MODEL, {}, data_dir=str(data)) as (base, _):
        assert _complete(base, "flip", "abc=") == "cba"
        assert _complete(base, f"flip@{revision[:12]}", "xyz=") == "zyx"


def test_one_server_per_data_directory(tmp_path: Path) -> None:
    with live_server(MODEL, {}, data_dir=str(tmp_path)):
        settings = ServerSettings(model=MODEL, data_dir=str(tmp_path))
        with pytest.raises(DataDirLockedError, match="talk to that server"):
            build_server(settings, EngineConfig(model_dir=MODEL), progress=False)
