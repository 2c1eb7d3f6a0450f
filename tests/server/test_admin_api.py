"""The admin API on a live server, through real HTTP: who may call it, registering (idempotent,
refusals that change nothing), tenants' isolation and quotas, the audit log, the schema."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
from helpers.admin_server import (
    ADMIN,
    BASE,
    admin,
    admin_server,
    auth,
    complete,
    create_key,
    demo_traffic,
    text,
)

from loraplex.adapters.registry_db import RegistryDB, adapters


def test_admin_api_needs_an_admin_key(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    with admin_server(monkeypatch, tmp_path) as (base, _, _):
        url = f"{base}/admin/v1/adapters"
        assert httpx.get(url).status_code == 401
        assert httpx.get(url, headers=auth("not-a-key")).status_code == 401
        data_key = create_key(base, "default")
        refused = httpx.get(url, headers=auth(data_key))
        assert refused.status_code == 403
        assert refused.json()["error"]["code"] == "admin_key_required"
        # ...refused before its body is read: a data key's registration changes nothing
        post = httpx.post(url, json={"name": "x", "source": "/nope"}, headers=auth(data_key))
        assert post.status_code == 403
        assert text(complete(base, data_key, "reverse")) == "cba"  # the data plane is its to use
        assert admin("GET", base, "/adapters").status_code == 200
        schema = httpx.get(f"{base}/openapi.json", headers=auth(ADMIN)).json()
        for path in ("/admin/v1/adapters", "/admin/v1/aliases/{alias}", "/admin/v1/audit", "/admin/v1/keys"):
            assert path in schema["paths"], path
        assert "/admin/v1/adapters/{name}@{revision}" in schema["paths"]
        assert "RegisterAdapter" in schema["components"]["schemas"]


def test_register_is_idempotent_and_refusals_change_nothing(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    with admin_server(monkeypatch, tmp_path) as (base, server, root):
        body = {"name": "flip", "source": str(root / "reverse"), "visibility": "shared"}
        first = admin("POST", base, "/adapters", json=body)
        assert first.status_code == 201, first.text
        again = admin("POST", base, "/adapters", json=body)
        assert again.status_code == 200 and again.json()["created"] is False
        assert again.json()["revision"] == first.json()["revision"]
        assert text(complete(base, ADMIN, "flip")) == "cba"
        db: RegistryDB = server.control.db
        rows = db.count(adapters)
        store = server.control.store.revisions()
        for bad, reason in [
            ({"name": "x", "source": str(tmp_path)}, "outside the allowed source roots"),
            ({"name": "x", "source": str(root / "reverse" / ".." / "upper")}, "'..' is not allowed"),
            ({"name": "x", "source": "http://example.com/a"}, "not an allowed source host"),
            ({"name": "../x", "source": str(root / "upper")}, "invalid adapter name"),
            ({"name": "x", "source": str(root / "upper"), "sha256": "0" * 64}, "checksum mismatch"),
            ({"name": "x", "source": str(root / "upper"), "tenant": "nobody"}, "unknown tenant"),
            ({"name": BASE, "source": str(root / "upper")}, "the base model's name"),
            ({"name": "x", "source": 5}, "source"),
            ({"name": "x"}, "source"),
        ]:
            out = admin("POST", base, "/adapters", json=body | bad if "source" in bad else bad)
            assert 400 <= out.status_code < 500, (bad, out.text)
            assert reason in out.json()["error"]["message"], (bad, out.text)
        assert db.count(adapters) == rows and server.control.store.revisions() == store
        names = {m["id"] for m in httpx.get(f"{base}/v1/models", headers=auth(ADMIN)).json()["data"]}
        assert "x" not in names and "flip" in names
        refusals = [r for r in db.audit(limit=1000) if r["result"] == "refused"]
        assert len(refusals) >= 5 and all(r["principal"] == "LORAPLEX_ADMIN_KEY" for r in refusals)


def test_tenants_see_and_use_only_their_own_and_shared(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    with admin_server(monkeypatch, tmp_path) as (base, _, root):
        for tenant in ("acme", "globex"):
            assert admin("POST", base, "/tenants", json={"name": tenant}).status_code == 201
        acme, globex = create_key(base, "acme"), create_key(base, "globex")
        reg = admin(
            "POST",
            base,
            "/adapters",
            json={"name": "secret", "source": str(root / "upper"), "tenant": "acme"},
        )
        assert reg.status_code == 201, reg.text
        revision = reg.json()["revision"]

        def ids(key: str) -> set[str]:
            return {m["id"] for m in httpx.get(f"{base}/v1/models", headers=auth(key)).json()["data"]}

        assert "secret" in ids(acme) and "reverse" in ids(acme)  # its own and the shared demo ones
        assert "secret" not in ids(globex) and "reverse" in ids(globex)
        assert text(complete(base, acme, "secret")) == "ABC="[:3]
        for spec in ("secret", f"secret@{revision[:12]}"):
            hidden = complete(base, globex, spec)
            unknown = complete(base, globex, spec.replace("secret", "secreu"))
            assert hidden.status_code == unknown.status_code == 404
            assert (
                hidden.json()["error"]["message"].replace("secret", "secreu")
                == unknown.json()["error"]["message"]
            )
            model = httpx.get(f"{base}/v1/models/{spec}", headers=auth(globex))
            assert model.status_code == 404

        def metrics(key: str) -> str:
            return httpx.get(f"{base}/metrics", headers=auth(key)).text

        assert 'adapter="secret"' in metrics(acme) and 'adapter="secret"' in metrics(ADMIN)
        assert 'adapter="secret"' not in metrics(globex) and "loraplex_requests_total" in metrics(globex)
        assert admin("POST", base, "/tenants", json={"name": "acme"}).status_code == 409
        taken = admin(
            "POST",
            base,
            "/adapters",
            json={"name": "secret", "source": str(root / "sort"), "tenant": "globex"},
        )
        assert taken.status_code == 409 and "another tenant" in taken.text


def test_quotas(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    with admin_server(monkeypatch, tmp_path) as (base, _, root):
        quotas = {"max_adapters": 1, "max_rank": 12, "max_concurrent_requests": 1}
        assert admin("POST", base, "/tenants", json={"name": "small", "quotas": quotas}).status_code == 201
        tiny = {"max_adapter_bytes": 1000}
        assert admin("POST", base, "/tenants", json={"name": "tiny", "quotas": tiny}).status_code == 201
        bad = admin("POST", base, "/tenants", json={"name": "bad", "quotas": {"max_rank": -1}})
        assert bad.status_code == 400 and "max_rank" in bad.text

        def register(name: str, source: str, tenant: str) -> httpx.Response:
            return admin(
                "POST", base, "/adapters", json={"name": name, "source": str(root / source), "tenant": tenant}
            )

        rank16 = register("r16", "reverse", "small")
        assert rank16.status_code == 403 and "ranks up to 12" in rank16.text
        assert register("u8", "upper", "small").status_code == 201
        assert register("u8", "upper", "small").status_code == 200  # idempotent: adds nothing
        second = register("c8", "caesar", "small")
        assert second.status_code == 403 and "at most 1 adapters" in second.text
        assert second.json()["error"]["code"] == "registration_refused"
        big = register("t", "upper", "tiny")
        assert big.status_code == 413 and "1000 bytes" in big.text

        key = create_key(base, "small")
        body = {"model": "u8", "prompt": "abc=", "max_tokens": 58, "ignore_eos": True, "stream": True}
        with httpx.stream(
            "POST", f"{base}/v1/completions", json=body, headers=auth(key), timeout=60
        ) as stream:
            lines = stream.iter_lines()
            assert next(lines).startswith("data: ")  # the first request is running
            busy = complete(base, key, "u8")
            assert busy.status_code == 429 and "Retry-After" in busy.headers
            for _ in lines:
                pass
        assert text(complete(base, key, "u8")) == "ABC"  # its slot is free again


def test_every_admin_action_is_audited_with_its_principal(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    with admin_server(monkeypatch, tmp_path) as (base, _, root):
        assert admin("POST", base, "/tenants", json={"name": "t1"}).status_code == 201
        other_admin = create_key(base, "t1", role="admin")
        reg = admin(
            "POST", base, "/adapters", json={"name": "s2", "source": str(root / "sort")}, key=other_admin
        )
        revision = reg.json()["revision"]
        assert admin("PUT", base, "/aliases/s2/latest", json={"target": f"s2@{revision}"}).status_code == 200
        assert admin("DELETE", base, f"/adapters/s2@{revision[:10]}", key=other_admin).status_code == 200
        key_id = admin("GET", base, "/keys").json()["data"][0]["key_id"]
        assert admin("DELETE", base, f"/keys/{key_id}").status_code == 200
        page = admin("GET", base, "/audit", params={"offset": 0, "limit": 1000}).json()
        seen = {(e["action"], e["principal"].split("#")[0]) for e in page["entries"] if e["result"] == "ok"}
        for action, who in [
            ("tenant", "LORAPLEX_ADMIN_KEY"),
            ("key", "LORAPLEX_ADMIN_KEY"),
            ("register", "t1-admin"),
            ("alias", "LORAPLEX_ADMIN_KEY"),
            ("state:draining", "t1-admin"),
            ("revoke", "LORAPLEX_ADMIN_KEY"),
        ]:
            assert (action, who) in seen, (action, who, seen)
        first = admin("GET", base, "/audit", params={"limit": 2}).json()
        assert len(first["entries"]) == 2 and first["next_offset"] == 2
        assert admin("GET", base, "/audit", params={"limit": "many"}).status_code == 400


def test_generation_is_correct_while_adapters_register(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    with admin_server(monkeypatch, tmp_path) as (base, _, root):
        with demo_traffic(base) as wrong:
            for i, source in enumerate(["reverse", "upper", "sort", "caesar"] * 2):
                out = admin("POST", base, "/adapters", json={"name": f"n{i}", "source": str(root / source)})
                assert out.status_code == 201, out.text
        assert not wrong, wrong[:3]
        assert text(complete(base, ADMIN, "n2", "cab=")) == text(complete(base, ADMIN, "sort", "cab="))
