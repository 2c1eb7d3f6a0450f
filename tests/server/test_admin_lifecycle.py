"""Aliases and retirement on a live server, with requests streaming: a request keeps the revision
it was admitted with; new requests see the repointed alias, or a 404 naming the retired revision;
a retired revision's memory is freed when its last request ends."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from helpers.admin_server import ADMIN, admin, admin_server, auth, complete, text

LONG = {"prompt": "abc=", "max_tokens": 58, "ignore_eos": True, "temperature": 0}


def _stream(base: str, model: str) -> Iterator[str]:
    """The streamed text pieces of one long request (the generator holds the connection)."""
    body = {"model": model, "stream": True, **LONG}
    with httpx.stream("POST", f"{base}/v1/completions", json=body, headers=auth(ADMIN), timeout=60) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                yield json.loads(line[6:])["choices"][0]["text"]


def _full(base: str, model: str) -> str:
    return text(complete(base, ADMIN, model, **LONG))


def test_alias_repoint_while_a_request_streams(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    with admin_server(monkeypatch, tmp_path) as (base, server, _):
        engine = server.async_engine.engine
        rev = {n: engine.adapters.latest(n).revision for n in ("reverse", "upper")}
        out = admin("PUT", base, "/aliases/tasks/latest", json={"target": f"reverse@{rev['reverse'][:16]}"})
        assert out.status_code == 200 and out.json()["previous"] is None
        assert text(complete(base, ADMIN, "tasks/latest")) == "cba"
        stream = _stream(base, "tasks/latest")
        pieces = [next(stream)]  # admitted, generating on reverse
        out = admin("PUT", base, "/aliases/tasks/latest", json={"target": f"upper@{rev['upper']}"})
        assert out.json()["previous"] == f"reverse@{rev['reverse']}"
        assert text(complete(base, ADMIN, "tasks/latest")) == "ABC"  # new requests: the new target
        models = httpx.get(f"{base}/v1/models", headers=auth(ADMIN)).json()["data"]
        assert {"id": "tasks/latest", "revision": rev["upper"]}.items() <= next(
            m for m in models if m["id"] == "tasks/latest"
        ).items()
        pieces.extend(stream)
        assert "".join(pieces) == _full(base, "reverse")  # the running one kept its revision
        listing = admin("GET", base, "/adapters/upper").json()
        assert listing["aliases"] == {"tasks/latest": f"upper@{rev['upper']}"}
        for bad, status in [("reverse", 400), ("nope@abcdef", 404)]:
            assert admin("PUT", base, "/aliases/x", json={"target": bad}).status_code == status
        target = {"target": f"reverse@{rev['reverse']}"}
        assert admin("PUT", base, "/aliases/loraplex-demo", json=target).status_code == 409
        assert (
            admin("PUT", base, "/aliases/upper", json={"target": f"reverse@{rev['reverse']}"}).status_code
            == 409
        )


def test_retire_drains_then_frees(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    with admin_server(monkeypatch, tmp_path) as (base, server, root):
        engine = server.async_engine.engine
        reg = admin("POST", base, "/adapters", json={"name": "shout", "source": str(root / "upper")})
        revision = reg.json()["revision"]
        resident = engine.residency.num_resident  # 'shout' shares 'upper''s slot: same content
        stream = _stream(base, "shout")
        pieces = [next(stream)]
        out = admin("DELETE", base, f"/adapters/shout@{revision[:12]}")
        assert out.status_code == 200 and out.json() == {
            "name": "shout",
            "revision": revision,
            "state": "draining",
            "in_flight": 1,
        }
        for spec in ("shout", f"shout@{revision[:12]}"):
            refused = complete(base, ADMIN, spec)
            assert refused.status_code == 404 and "retired" in refused.json()["error"]["message"]
            assert refused.json()["error"]["code"] == "model_retired"
        assert text(complete(base, ADMIN, "upper")) == "ABC"  # the same content under its own name
        pieces.extend(stream)
        assert "".join(pieces) == _full(base, "upper")  # the in-flight request finished on it
        assert admin("DELETE", base, f"/adapters/shout@{revision}").status_code == 409
        deadline = time.monotonic() + 10
        while admin("GET", base, "/adapters/shout").json()["revisions"][0]["state"] != "retired":
            assert time.monotonic() < deadline, "the drained revision was never recorded retired"
            time.sleep(0.05)
        assert engine.residency.num_resident == resident  # 'upper' still serves that slot

        # A revision no other name serves: its slot is freed once drained (here: at once).
        own = admin(
            "POST",
            base,
            "/adapters",
            json={"name": "own", "source": str(root / "caesar"), "visibility": "shared"},
        )
        # caesar's content is the demo's 'caesar' too; retire both names, and the slot goes.
        resident = engine.residency.num_resident
        for name in ("own", "caesar"):
            rev = own.json()["revision"]
            assert admin("DELETE", base, f"/adapters/{name}@{rev}").status_code == 200
        assert engine.residency.num_resident == resident - 1
        models = {m["id"] for m in httpx.get(f"{base}/v1/models", headers=auth(ADMIN)).json()["data"]}
        assert "caesar" not in models and "own" not in models and "upper" in models
