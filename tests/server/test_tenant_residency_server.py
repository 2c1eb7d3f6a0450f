"""Tenant residency limits through the admin API on a live server whose device pool holds one demo
adapter: set at creation and by PATCH (bad values are 400s naming the field), shown in
`GET /admin/v1/residency`, refused with a 409 when all tenants' guaranteed bytes would exceed
the device budget (a restart on stored limits that do only warns), applied without a restart (a
cold load over the rate is refused with a 429 and `Retry-After`, then allowed once the limit is
lifted), persisted across a restart; and the residency histograms and counters of `/metrics` move
under eviction pressure."""

from __future__ import annotations

import re
from pathlib import Path

import httpx
import pytest
from helpers.admin_server import ADMIN, MODEL, admin, auth, complete, demo_footprint, sources
from helpers.live_server import live_server

from loraplex.adapters.registry_db import RegistryDB
from loraplex.config import LoRAConfig
from loraplex.demo import DEMO_ADAPTERS


def _series(metrics: str, name: str) -> float:
    """The sum of every sample of `name` (all label sets)."""
    values = re.findall(rf"^{re.escape(name)}(?:{{[^}}]*}})? (\S+)$", metrics, re.MULTILINE)
    assert values, f"{name} missing from /metrics"
    return sum(float(v) for v in values)


def test_residency_limits_through_the_admin_api(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("LORAPLEX_ADMIN_KEY", ADMIN)
    room = max(demo_footprint(p) for p in DEMO_ADAPTERS.values())
    lora = LoRAConfig(adapter_device_bytes=room, adapter_host_bytes=0)
    demo = {k: str(v) for k, v in DEMO_ADAPTERS.items()}
    tasks = list(demo)
    root = sources(tmp_path / "sources")
    data_dir = str(tmp_path / "data")
    with live_server(MODEL, demo, source_roots=(str(root),), lora=lora, data_dir=data_dir) as (base, _):
        made = admin("POST", base, "/tenants", json={"name": "gold", "residency": {"priority": 4}})
        assert made.status_code == 201 and made.json()["residency"] == {"priority": 4.0}, made.text
        bad = admin("POST", base, "/tenants", json={"name": "lead", "residency": {"priority": 0}})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "residency.priority"
        for body, param in (
            ({"guaranteed_bytes": -5}, "guaranteed_bytes"),
            ({"cold_load_over_rate": "later"}, "cold_load_over_rate"),
            ({"device_budget_bytes": "1GB"}, "device_budget_bytes"),
            ({"colour": 1}, "colour"),
        ):
            refused = admin("PATCH", base, "/tenants/gold/residency", json=body)
            assert refused.status_code == 400, refused.text
            assert refused.json()["error"]["param"] == param
        assert admin("PATCH", base, "/tenants/nobody/residency", json={}).status_code == 404
        changed = admin("PATCH", base, "/tenants/gold/residency", json={"guaranteed_adapters": 1})
        assert changed.status_code == 200, changed.text
        assert changed.json()["residency"] == {"priority": 4.0, "guaranteed_adapters": 1}
        gold = admin("GET", base, "/residency").json()["tenants"]["gold"]
        assert gold["limits"]["priority"] == 4.0 and gold["limits"]["guaranteed_adapters"] == 1

        # Guarantees are promises of device bytes: together they may not exceed the pool.
        whole = admin("PATCH", base, "/tenants/gold/residency", json={"guaranteed_bytes": room})
        assert whole.status_code == 200, whole.text
        over = admin("POST", base, "/tenants", json={"name": "lead", "residency": {"guaranteed_bytes": 1}})
        assert over.status_code == 409, over.text
        message = over.json()["error"]["message"]
        assert f"sum to {room + 1} (gold {room}, lead 1)" in message and f"budget of {room} bytes" in message
        assert "lead" not in {t["name"] for t in admin("GET", base, "/tenants").json()["data"]}
        over = admin("PATCH", base, "/tenants/default/residency", json={"guaranteed_bytes": 2})
        assert over.status_code == 409 and "default 2, gold" in over.json()["error"]["message"]
        kept = admin("GET", base, "/residency").json()["tenants"]["default"]["limits"]
        assert kept["guaranteed_bytes"] == 0
        reset = admin("PATCH", base, "/tenants/gold/residency", json={"guaranteed_bytes": None})
        assert reset.status_code == 200, reset.text

        # The demo adapters are the default tenant's. Under pressure every residency measurement moves.
        for i in range(8):
            r = complete(base, ADMIN, tasks[i % len(tasks)])
            assert r.status_code == 200, r.text
        metrics = httpx.get(f"{base}/metrics", headers=auth(ADMIN)).text
        for name in (
            "loraplex_adapter_load_seconds_count",
            "loraplex_adapter_time_to_first_token_seconds_count",
            "loraplex_adapter_host_to_device_bytes_total",
            "loraplex_adapter_evictions_total",
            "loraplex_adapter_stalled_requests_total",
            "loraplex_adapter_stall_seconds_total",
            "loraplex_adapter_admissions_total",
        ):
            assert _series(metrics, name) > 0, name
        tiers = admin("GET", base, "/residency").json()["tiers"]
        assert tiers["load_seconds"]["disk"]["count"] > 0 and tiers["stall_seconds"] > 0

        # Over the default tenant's cold-load rate with `refuse`: the next cold load is a 429.
        limit = {"cold_load_bytes_per_minute": 1, "cold_load_over_rate": "refuse"}
        assert admin("PATCH", base, "/tenants/default/residency", json=limit).status_code == 200
        answers = [complete(base, ADMIN, tasks[i % len(tasks)]) for i in range(3)]
        refused = [r for r in answers if r.status_code == 429]
        assert refused and "over its cold-load rate" in refused[0].json()["error"]["message"]
        assert int(refused[0].headers["Retry-After"]) >= 1
        reset = {"cold_load_bytes_per_minute": None, "cold_load_over_rate": None}
        assert admin("PATCH", base, "/tenants/default/residency", json=reset).json()["residency"] == {}
        assert all(complete(base, ADMIN, t).status_code == 200 for t in tasks)  # no restart needed
    # Limits stored past the API (offline, or under a larger budget) that overcommit: the next
    # startup warns and serves.
    db = RegistryDB.in_dir(data_dir)
    db.set_residency("default", {"guaranteed_bytes": 2 * room}, "test")
    db.close()
    capfd.readouterr()
    with live_server(MODEL, demo, source_roots=(str(root),), lora=lora, data_dir=data_dir) as (base, _):
        tenants = {t["name"]: t for t in admin("GET", base, "/tenants").json()["data"]}
        assert tenants["gold"]["residency"] == {"priority": 4.0, "guaranteed_adapters": 1}
        assert admin("GET", base, "/residency").json()["tenants"]["gold"]["limits"]["priority"] == 4.0
        assert all(complete(base, ADMIN, t).status_code == 200 for t in tasks)
    warned = capfd.readouterr().err
    assert f"warning: the tenants' guaranteed device bytes sum to {2 * room} (default {2 * room})" in warned
