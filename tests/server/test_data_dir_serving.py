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


def test_a_restart_says_when_the_name_serves_another_revision(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The command line's directory registers once; a revision published under the same name
    afterwards is what the name serves after a restart, and the startup says so (and how to
    serve the directory's revision again); once that newer one is retired it says nothing."""
    data = str(tmp_path / "data")
    config = EngineConfig(model_dir=MODEL)

    def start(adapters: dict[str, str]) -> tuple[str | None, str]:
        server = build_server(ServerSettings(model=MODEL, data_dir=data, adapters=adapters), config, False)
        registry = server.async_engine.engine.adapters
        live = [
            e.ref.revision for e in registry.list() if e.ref.name == "flip" and not registry.is_retired(e.ref)
        ]
        served = registry.latest("flip").revision if live else None
        server.control.close()
        return served, capsys.readouterr().err

    first, said = start({"flip": str(DEMO_ADAPTERS["reverse"])})
    assert "warning" not in said
    newer, said = start({"flip": str(DEMO_ADAPTERS["upper"])})  # publishes a second revision
    assert newer != first and "warning" not in said
    served, said = start({"flip": str(DEMO_ADAPTERS["reverse"])})
    assert served == newer
    assert f"'flip' serves {newer[:12]}, published after {first[:12]}" in said
    assert f"loraplex adapters retire flip@{newer[:12]}" in said
    db = RegistryDB.in_dir(data)
    db.set_state("flip", newer, "draining", "test")
    db.set_state("flip", newer, "retired", "test")
    db.close()
    served, said = start({"flip": str(DEMO_ADAPTERS["reverse"])})
    assert served == first and "warning" not in said
    db = RegistryDB.in_dir(data)
    db.set_state("flip", first, "draining", "test")
    db.set_state("flip", first, "retired", "test")
    db.close()
    served, said = start({"flip": str(DEMO_ADAPTERS["reverse"])})
    assert served is None
    assert f"flip@{first[:12]} from the command line is retired in the registry" in said
