"""`loraplex serve`: build the engine, register adapters, run the HTTP server."""

from __future__ import annotations

import json
import os
import sys
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from loraplex.config import EngineConfig
from loraplex.engine.engine import Engine
from loraplex.server.async_engine import AsyncEngine
from loraplex.server.limits import ServerLimits
from loraplex.server.metrics import ServerMetrics


@dataclass
class ServerSettings:
    model: str | None = None  # None: the bundled demo model with all its adapters
    adapters: dict[str, str] = field(default_factory=dict)
    host: str = "127.0.0.1"
    port: int = 8000
    served_model_name: str | None = None
    api_keys: list[str] = field(default_factory=list)
    limits: ServerLimits = field(default_factory=ServerLimits)  # `[limits]` in a config file
    prepare_workers: int = 4  # threads that parse, validate and tokenize requests
    engine: dict[str, Any] = field(default_factory=dict)  # EngineConfig fields (flat or nested sections)


def load_settings_file(path: Path) -> ServerSettings:
    """A TOML or JSON file with the ServerSettings fields."""
    text = path.read_text()
    try:
        raw = tomllib.loads(text) if path.suffix == ".toml" else json.loads(text)
    except (tomllib.TOMLDecodeError, json.JSONDecodeError) as err:
        raise ValueError(f"cannot parse config file {path}: {err}") from None
    unknown = set(raw) - set(ServerSettings.__dataclass_fields__)
    if unknown:
        raise ValueError(f"unknown keys in {path}: {', '.join(sorted(unknown))}")
    if "limits" in raw:
        if not isinstance(raw["limits"], dict):
            raise ValueError(f"limits in {path} must be a table of limit = value")
        raw["limits"] = ServerLimits.from_mapping(raw["limits"])
    return ServerSettings(**raw)


@dataclass
class Server:
    app: Any
    async_engine: AsyncEngine
    metrics: ServerMetrics
    served_model: str

    def close(self) -> None:
        self.async_engine.shutdown()
        self.app.state.prepare_pool.shutdown(wait=False, cancel_futures=True)


def build_server(settings: ServerSettings, engine_config: EngineConfig, progress: bool = True) -> Server:
    from loraplex.server.openai_api import create_app

    engine = Engine(engine_config, progress=progress)
    for name, path in settings.adapters.items():
        ref = engine.register_adapter(name, path)
        if progress:
            print(f"  adapter {ref.name}@{ref.revision[:12]}", file=sys.stderr)
    served = settings.served_model_name or _default_name(engine_config.model_dir)
    if served in settings.adapters:
        raise ValueError(f"served model name {served!r} collides with an adapter name")
    metrics = ServerMetrics()
    async_engine = AsyncEngine(engine, metrics)
    keys = frozenset(settings.api_keys) | frozenset(
        k for k in os.environ.get("LORAPLEX_API_KEYS", "").split(",") if k
    )
    if settings.prepare_workers < 1:
        raise ValueError(f"prepare_workers must be >= 1, got {settings.prepare_workers}")
    app = create_app(async_engine, served, metrics, keys, settings.limits, settings.prepare_workers)
    return Server(app, async_engine, metrics, served)


def _default_name(model_dir: str) -> str:
    from loraplex.demo import DEMO_MODEL_DIR

    if Path(model_dir).resolve() == Path(DEMO_MODEL_DIR).resolve():
        return "loraplex-demo"
    return Path(model_dir).resolve().name


def run_server(server: Server, host: str, port: int) -> None:
    import uvicorn

    server.async_engine.start()
    adapters = [r.ref for r in server.async_engine.engine.adapters.list_latest()]
    print(f"loraplex serving {server.served_model!r} on http://{host}:{port}/v1", file=sys.stderr)
    for ref in adapters:
        print(f"  model {ref.name!r} (adapter, revision {ref.revision[:12]})", file=sys.stderr)
    try:
        uvicorn.run(server.app, host=host, port=port, log_level="warning")
    finally:
        server.close()
