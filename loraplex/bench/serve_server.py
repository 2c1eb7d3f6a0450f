"""The server `loraplex bench serve --http-compare` starts for itself: the same engine as the
in-process run (`serve_model.build_engine`: the demo model, a model directory, or random weights
made on the device from the workload's seed, nothing written), behind the real HTTP server, in its
own process, so that the load client (the bench's process) shares no interpreter with it.

`python -m loraplex.bench.serve_server ARGS_JSON` (the bench's ServeBenchArgs as JSON) builds it,
binds a free 127.0.0.1 port and prints one JSON line on stdout before serving: the port, the
adapter name of each workload adapter index, and the vocabulary size. Only this process imports
the server's packages (fastapi, uvicorn); the bench imports none of them.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from loraplex.bench.serve_model import ServeBenchArgs

STARTUP_TIMEOUT_S = 1800  # random Llama-3-8B-shaped weights, adapters and warm-up on a GPU
SERVED_NAME = "bench-base"


@contextmanager
def bench_server(args: ServeBenchArgs) -> Iterator[tuple[str, list[str], int]]:
    """Start the server process on `args`' engine; yields its base URL, the adapter name of each
    workload adapter index and the vocabulary size. The process is stopped on exit."""
    blob = json.dumps({**asdict(args), "url": None})
    proc = subprocess.Popen(
        [sys.executable, "-m", "loraplex.bench.serve_server", blob], stdout=subprocess.PIPE, text=True
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()  # blocks until the server is built (or the process died)
        if not line:
            raise RuntimeError(f"the bench server exited with status {proc.wait()} before serving")
        ready = json.loads(line)
        url = f"http://127.0.0.1:{ready['port']}"
        _wait_healthy(url, proc)
        yield url, ready["adapters"], ready["vocab"]
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _wait_healthy(url: str, proc: subprocess.Popen[str]) -> None:
    import httpx

    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the bench server exited with status {proc.returncode}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.05)
    raise RuntimeError(f"the bench server at {url} did not become healthy")


def _args_from_json(blob: str) -> ServeBenchArgs:
    from loraplex.bench.serve_model import ServeBenchArgs
    from loraplex.bench.workloads import WorkloadSpec

    raw: dict[str, Any] = json.loads(blob)
    return ServeBenchArgs(**{**raw, "workload": WorkloadSpec(**raw["workload"])})


def main(argv: list[str]) -> int:
    import asyncio
    import socket

    import uvicorn

    from loraplex.bench.serve_model import build_engine
    from loraplex.bench.workloads import generate
    from loraplex.server.serve import ServerSettings, build_server

    args = _args_from_json(argv[0])
    engine, names, _ = build_engine(args, generate(args.workload))
    settings = ServerSettings(served_model_name=SERVED_NAME)
    server = build_server(settings, engine.config, progress=False, engine=engine)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server.async_engine.start()
    port = sock.getsockname()[1]
    print(json.dumps({"port": port, "adapters": names, "vocab": engine.model_config.vocab_size}), flush=True)
    # keep-alive as long as a run: an idle pooled connection the server closed would fail a request
    config = uvicorn.Config(server.app, log_level="warning", access_log=False, timeout_keep_alive=3600)
    try:
        asyncio.run(uvicorn.Server(config).serve(sockets=[sock]))
    finally:
        server.close()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
