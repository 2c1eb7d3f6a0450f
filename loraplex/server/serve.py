"""`loraplex serve`: build the engine, register adapters, run the HTTP server."""

from __future__ import annotations

import json
import os
import sys
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from loraplex.config import EngineConfig
from loraplex.engine.engine import Engine
from loraplex.server.async_engine import AsyncEngine
from loraplex.server.limits import ServerLimits
from loraplex.server.metrics import ServerMetrics

if TYPE_CHECKING:
    from loraplex.server.control import ControlService


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
    # The registry, the adapter store and the writer lock; None: a temporary directory removed at
    # close (tests and embedded servers; the command line's default is the per-user directory).
    data_dir: str | None = None
    source_roots: list[str] = field(default_factory=list)  # local directories the admin API may read
    source_hosts: list[str] = field(default_factory=list)  # http(s) hosts the admin API may fetch from
    engine: dict[str, Any] = field(default_factory=dict)  # EngineConfig fields (flat or nested sections)
    # Label caps of the per-request metrics (`server/request_metrics.py`): at most this many adapter
    # names / tenants get series of their own, each once it has sent `metrics_min_requests`
    # requests; the rest are counted under `_other`.
    metrics_max_adapters: int = 64
    metrics_max_tenants: int = 64
    metrics_min_requests: int = 1


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
    control: ControlService

    def close(self) -> None:
        self.async_engine.shutdown()
        self.app.state.prepare_pool.shutdown(wait=False, cancel_futures=True)
        self.control.close()


def build_server(
    settings: ServerSettings, engine_config: EngineConfig, progress: bool = True, engine: Engine | None = None
) -> Server:
    """Load the engine (or serve `engine`, built on `engine_config` already: the serving bench's
    random weights), open the data directory (its lock held until `close`), register the startup
    adapters through the control plane, serve every registered revision, and build the app."""
    from loraplex.adapters.sources import SourcePolicy
    from loraplex.server.control import ADMIN_ENV, ControlService
    from loraplex.server.openai_api import create_app

    if settings.prepare_workers < 1:
        raise ValueError(f"prepare_workers must be >= 1, got {settings.prepare_workers}")
    if engine is None:
        engine = Engine(engine_config, progress=progress)
    served = settings.served_model_name or _default_name(engine_config.model_dir)
    if served in settings.adapters:
        raise ValueError(f"served model name {served!r} collides with an adapter name")
    policy = SourcePolicy(
        roots=tuple(Path(r) for r in settings.source_roots), hosts=tuple(settings.source_hosts)
    )
    control = ControlService(settings.data_dir, engine, policy)
    control.served_model = served
    try:
        control.register_startup(settings.adapters, progress)
        control.load_registered()
        if any(entry.ref.name == served for entry in engine.adapters.list()):
            raise ValueError(f"served model name {served!r} collides with a registered adapter's name")
        tokens = [*settings.api_keys, *(k for k in os.environ.get("LORAPLEX_API_KEYS", "").split(",") if k)]
        keys = control.load_keys(tokens, os.environ.get(ADMIN_ENV))
        metrics = ServerMetrics(
            settings.metrics_max_adapters, settings.metrics_max_tenants, settings.metrics_min_requests
        )
        async_engine = AsyncEngine(engine, metrics)
        control.async_engine = async_engine
        app = create_app(
            async_engine, served, metrics, keys, settings.limits, settings.prepare_workers, control
        )
    except BaseException:
        control.close()
        raise
    return Server(app, async_engine, metrics, served, control)


def _default_name(model_dir: str) -> str:
    from loraplex.demo import DEMO_MODEL_DIR

    if Path(model_dir).resolve() == Path(DEMO_MODEL_DIR).resolve():
        return "loraplex-demo"
    return Path(model_dir).resolve().name


def _mib(nbytes: int) -> str:
    return f"{nbytes / 2**20:.1f} MiB"


def run_server(server: Server, host: str, port: int) -> None:
    import uvicorn

    server.async_engine.start()
    adapters = [r.ref for r in server.async_engine.engine.adapters.list_latest()]
    print(f"loraplex serving {server.served_model!r} on http://{host}:{port}/v1", file=sys.stderr)
    print(f"  data directory {server.control.data_dir}", file=sys.stderr)
    if not server.control.keys:
        print(
            "  no API keys configured: the data plane is open to anyone (one default tenant) and the "
            "admin API is closed (set LORAPLEX_ADMIN_KEY or run `loraplex keys create --admin`)",
            file=sys.stderr,
        )
    else:  # an admin key alone closes the open demo too: say so before the first 401 does
        print(
            "  API keys required: every request needs `Authorization: Bearer <key>` (a data key, or "
            "an admin key acting as its tenant)",
            file=sys.stderr,
        )
    tiers = server.async_engine.engine.tiers
    print(
        f"  adapter memory: device pool {_mib(tiers.pool.budget_bytes)} (--adapter-device-bytes; "
        f"{tiers.residency.num_resident} adapter revisions on it now), host tier "
        f"{_mib(tiers.host.budget_bytes)} (--adapter-host-bytes); others load on first request",
        file=sys.stderr,
    )
    for ref in adapters:
        print(f"  model {ref.name!r} (adapter, revision {ref.revision[:12]})", file=sys.stderr)
    try:
        uvicorn.run(server.app, host=host, port=port, log_level="warning")
    finally:
        server.close()
