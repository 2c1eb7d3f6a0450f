"""`loraplex adapters|tenants|keys`: offline on a data directory (and refused while a server holds
it), and online through a running server's admin API; answers are the admin API's JSON."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import pytest
from helpers.admin_server import ADMIN, admin_server, auth, complete, sources, text
from helpers.live_server import live_server

from loraplex import cli
from loraplex.adapters.registry_db import RegistryDB, adapters
from loraplex.demo import DEMO_MODEL_DIR


def _run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, Any, str]:
    code = cli.main(list(argv))
    out, err = capsys.readouterr()
    return code, json.loads(out) if code == 0 else None, err


def test_offline_on_a_data_directory(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    root = sources(tmp_path / "src")
    data = ["--data-dir", str(tmp_path / "data")]
    code, key, _ = _run(capsys, "keys", "create", "--admin", "--label", "ops", *data)
    assert code == 0 and key["role"] == "admin" and key["token"].startswith("lpx-")
    code, tenant, _ = _run(capsys, "tenants", "create", "acme", "--quota", "max_rank=16", *data)
    assert code == 0 and tenant == {"name": "acme", "quotas": {"max_rank": 16}}
    code, _, err = _run(capsys, "tenants", "create", "bad", "--quota", "max_ranks=1", *data)
    assert code == 1 and "unknown quotas: max_ranks" in err
    code, reg, _ = _run(
        capsys, "adapters", "register", "flip", str(root / "reverse"), "--tenant", "acme", *data
    )
    assert code == 0 and reg["created"] is True and reg["tenant"] == "acme"
    code, again, _ = _run(
        capsys, "adapters", "register", "flip", str(root / "reverse"), "--tenant", "acme", *data
    )
    assert code == 0 and again["created"] is False
    code, _, err = _run(capsys, "adapters", "register", "bad", str(tmp_path / "nowhere"), *data)
    assert code == 1 and "not found" in err
    revision = reg["revision"]
    code, out, _ = _run(capsys, "adapters", "alias", "flip/stable", f"flip@{revision[:10]}", *data)
    assert code == 0 and out["target"] == f"flip@{revision}"
    code, shown, _ = _run(capsys, "adapters", "show", "flip", *data)
    assert shown["aliases"] == {"flip/stable": f"flip@{revision}"} and shown["revisions"][0]["manifest"]
    code, listed, _ = _run(capsys, "adapters", "list", *data)
    assert [a["name"] for a in listed] == ["flip"]
    code, out, _ = _run(capsys, "adapters", "retire", f"flip@{revision}", *data)
    assert code == 0 and out["state"] == "retired"
    code, listed, _ = _run(capsys, "adapters", "list", *data)
    assert listed == []
    code, listed, _ = _run(capsys, "adapters", "list", "--all", *data)
    assert [a["state"] for a in listed] == ["retired"]
    db = RegistryDB.in_dir(str(tmp_path / "data"))
    assert db.count(adapters) == 1
    assert {r["principal"] for r in db.audit(limit=1000)} == {"cli (offline)"}
    db.close()

    # The admin key made offline opens the admin API of a server started later on that directory.
    with live_server(str(DEMO_MODEL_DIR), {}, data_dir=str(tmp_path / "data")) as (base, _):
        assert httpx.get(f"{base}/admin/v1/adapters", headers=auth(key["token"])).status_code == 200
        code, _, err = _run(capsys, "tenants", "create", "other", *data)
        assert code == 1 and "--url" in err  # the server holds the directory


def test_online_through_the_admin_api(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with admin_server(monkeypatch, tmp_path) as (base, _, root):
        online = ["--url", base, "--key", ADMIN]
        code, reg, _ = _run(
            capsys, "adapters", "register", "flip", str(root / "reverse"), "--visibility", "shared", *online
        )
        assert code == 0 and reg["created"] is True and reg["warnings"] == []
        assert text(complete(base, ADMIN, "flip")) == "cba"
        code, out, _ = _run(capsys, "adapters", "alias", "flip/latest", f"flip@{reg['revision']}", *online)
        assert code == 0
        code, key, _ = _run(capsys, "keys", "create", "--tenant", "default", "--label", "app", *online)
        assert text(complete(base, key["token"], "flip/latest")) == "cba"
        code, _, err = _run(capsys, "adapters", "retire", "flip@ffffffff", *online)
        assert code == 1 and err.startswith("error: 404:")
        code, out, _ = _run(capsys, "adapters", "retire", f"flip@{reg['revision']}", *online)
        assert code == 0 and out["state"] == "draining"
        code, out, _ = _run(capsys, "tenants", "residency", "default", "--guaranteed-adapters", "2", *online)
        assert code == 0 and out["residency"] == {"guaranteed_adapters": 2}
        code, _, err = _run(capsys, "tenants", "residency", "default", "--priority", "0", *online)
        assert code == 1 and "400: tenant priority must be > 0" in err
        too_much = ["--guaranteed-bytes", str(1 << 40)]
        code, _, err = _run(capsys, "tenants", "residency", "default", *too_much, *online)
        assert code == 1 and "409: the tenants' guaranteed device bytes sum to" in err
        code, _, err = _run(capsys, "adapters", "list", "--url", base, "--key", "wrong")
        assert code == 1 and "401" in err
        monkeypatch.delenv("LORAPLEX_ADMIN_KEY")
        assert cli.main(["adapters", "list", "--url", base, "--api-key", key["token"]]) == 0
        served = capsys.readouterr().out
        assert "loraplex-demo\tbase" in served and "reverse" in served and "flip" not in served


def test_tenant_residency_limits_offline(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    data = ["--data-dir", str(tmp_path / "data")]
    assert _run(capsys, "tenants", "create", "acme", *data)[0] == 0
    args = ["--priority", "2", "--guaranteed-adapters", "1", "--cold-load-bytes-per-minute", "1000"]
    code, out, _ = _run(capsys, "tenants", "residency", "acme", *args, *data)
    assert code == 0 and out["residency"] == {
        "priority": 2.0,
        "guaranteed_adapters": 1,
        "cold_load_bytes_per_minute": 1000,
    }
    assert out["effective"]["cold_load_over_rate"] == "wait"
    code, out, _ = _run(capsys, "tenants", "residency", "acme", "--reset", "priority", *data)
    assert code == 0 and "priority" not in out["residency"] and out["residency"]["guaranteed_adapters"] == 1
    code, _, err = _run(capsys, "tenants", "residency", "acme", "--guaranteed-bytes", "-1", *data)
    assert code == 1 and "guaranteed_bytes must be >= 0" in err
    code, _, err = _run(capsys, "tenants", "residency", "nobody", "--priority", "3", *data)
    assert code == 1 and "unknown tenant 'nobody'" in err
    code, listed, _ = _run(capsys, "tenants", "list", *data)
    assert {t["name"]: t["residency"] for t in listed}["acme"] == {
        "guaranteed_adapters": 1,
        "cold_load_bytes_per_minute": 1000,
    }
