"""Run a loraplex server in a background thread on a free 127.0.0.1 port (a real socket: the
official openai client talks to it over HTTP)."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import httpx
import uvicorn

from loraplex.config import EngineConfig, LoRAConfig, SchedulerConfig
from loraplex.server.limits import ServerLimits
from loraplex.server.serve import Server, ServerSettings, build_server


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def live_server(
    model: str,
    adapters: dict[str, str],
    limits: ServerLimits | None = None,
    api_keys: tuple[str, ...] = (),
    data_dir: str | None = None,
    source_roots: tuple[str, ...] = (),
    lora: LoRAConfig | None = None,
    settings_kw: dict | None = None,
    **engine_kw,  # noqa: ANN003
) -> Iterator[tuple[str, Server]]:
    """A server on `model` with `adapters`; `engine_kw` are SchedulerConfig fields; `lora` the LoRA
    settings (adapter tier budgets); `settings_kw` more ServerSettings fields; `data_dir` None: a
    temporary one."""
    settings = ServerSettings(
        model=model,
        adapters=adapters,
        api_keys=list(api_keys),
        data_dir=data_dir,
        source_roots=list(source_roots),
    )
    if limits is not None:
        settings.limits = limits
    for name, value in (settings_kw or {}).items():
        setattr(settings, name, value)
    config = EngineConfig(model_dir=model, scheduler=SchedulerConfig(**engine_kw), lora=lora or LoRAConfig())
    server = build_server(settings, config, progress=False)
    server.async_engine.start()
    port = free_port()
    uv = uvicorn.Server(uvicorn.Config(server.app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=uv.run, daemon=True)
    thread.start()
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            if httpx.get(base + "/health", timeout=1).status_code == 200:
                break
        except httpx.HTTPError:
            time.sleep(0.05)
    try:
        yield base, server
    finally:
        uv.should_exit = True
        thread.join(timeout=10)
        server.close()
