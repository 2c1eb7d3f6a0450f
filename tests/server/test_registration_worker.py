"""Admin registrations run in one spawned worker process at the lowest CPU priority; a worker that
died answers one registration with a 500 naming it (audited, nothing stored) and the next
registration starts a fresh one."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest
from helpers.admin_server import admin, admin_server

from loraplex.adapters.registry_db import adapters


def _worker_pids(server) -> list[int]:  # noqa: ANN001
    pool = server.control.worker._pool
    return [] if pool is None else [p.pid for p in pool._processes.values()]


def test_registrations_run_in_a_low_priority_worker(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    with admin_server(monkeypatch, tmp_path) as (base, server, root):
        assert _worker_pids(server) == []  # startup registrations ran in process
        out = admin("POST", base, "/adapters", json={"name": "one", "source": str(root / "sort")})
        assert out.status_code == 201, out.text
        (pid,) = _worker_pids(server)
        assert pid != os.getpid() and os.getpriority(os.PRIO_PROCESS, pid) == 19

        os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while server.control.worker._pool is not None and time.monotonic() < deadline:
            if not server.control.worker._pool._processes:  # the executor noticed
                break
            time.sleep(0.05)
        rows, stored = server.control.db.count(adapters), server.control.store.revisions()
        died = admin("POST", base, "/adapters", json={"name": "two", "source": str(root / "caesar")})
        assert died.status_code == 500 and "worker process died" in died.json()["error"]["message"]
        assert (server.control.db.count(adapters), server.control.store.revisions()) == (rows, stored)
        assert server.control.db.audit(limit=1000)[-1]["result"] == "refused"
        again = admin("POST", base, "/adapters", json={"name": "two", "source": str(root / "caesar")})
        assert again.status_code == 201, again.text
        assert _worker_pids(server) and _worker_pids(server) != [pid]
