"""The two ways the CLI administers adapters, tenants and keys, with the same answers (the admin
API's JSON):

- `HttpAdmin`: a running server's admin API (`--url`, an admin key). While a server runs it is the
  one writer of its data directory, so this is the only way to change anything then.
- `OfflineAdmin`: the registry file in a data directory, when no server runs. Reads need nothing;
  a write takes the directory's writer lock, and is refused (naming `--url`) while a server holds
  it. A registration offline runs the same pipeline as the server's (fetch, verify, scan, store,
  record); the operator's own source directory is its allowed root.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any
from urllib.parse import quote

OFFLINE = "cli (offline)"  # the audit log's principal for offline writes


class AdminError(Exception):
    """A refused or failed admin call; the message is the server's (or the registry's) reason."""


class HttpAdmin:
    def __init__(self, url: str, key: str | None) -> None:
        self.url = url.rstrip("/") + "/admin/v1"
        self.key = key

    def call(self, method: str, path: str, body: dict[str, Any] | None = None) -> Any:  # noqa: ANN401
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(self.url + path, data=data, method=method)
        req.add_header("Content-Type", "application/json")
        if self.key:
            req.add_header("Authorization", f"Bearer {self.key}")
        try:
            with urllib.request.urlopen(req, timeout=600) as resp:
                return json.load(resp)
        except urllib.error.HTTPError as err:
            try:
                message = json.load(err)["error"]["message"]
            except (ValueError, KeyError, TypeError):
                message = err.reason
            raise AdminError(f"{err.code}: {message}") from None
        except OSError as err:
            raise AdminError(f"cannot reach a loraplex server at {self.url}: {err}") from None

    def register(self, name: str, source: str, **fields: Any) -> Any:  # noqa: ANN401
        body = {"name": name, "source": source, **{k: v for k, v in fields.items() if v is not None}}
        return self.call("POST", "/adapters", body)

    def adapters(self, include_retired: bool) -> Any:  # noqa: ANN401
        return self.call("GET", f"/adapters?include_retired={str(include_retired).lower()}")["data"]

    def adapter(self, name: str) -> Any:  # noqa: ANN401
        return self.call("GET", f"/adapters/{quote(name)}")

    def alias(self, alias: str, target: str) -> Any:  # noqa: ANN401
        return self.call("PUT", f"/aliases/{quote(alias, safe='/')}", {"target": target})

    def retire(self, spec: str) -> Any:  # noqa: ANN401
        return self.call("DELETE", f"/adapters/{quote(spec, safe='@')}")

    def create_tenant(self, name: str, quotas: dict[str, int]) -> Any:  # noqa: ANN401
        return self.call("POST", "/tenants", {"name": name, "quotas": quotas})

    def tenants(self) -> Any:  # noqa: ANN401
        return self.call("GET", "/tenants")["data"]

    def set_residency(self, name: str, update: dict[str, Any]) -> Any:  # noqa: ANN401
        return self.call("PATCH", f"/tenants/{quote(name)}/residency", update)

    def create_key(self, role: str, tenant: str | None, label: str) -> Any:  # noqa: ANN401
        return self.call("POST", "/keys", {"role": role, "tenant": tenant, "label": label})

    def keys(self) -> Any:  # noqa: ANN401
        return self.call("GET", "/keys")["data"]

    def revoke_key(self, key_id: str) -> Any:  # noqa: ANN401
        return self.call("DELETE", f"/keys/{quote(key_id)}")


class OfflineAdmin:
    def __init__(self, data_dir: Path, model_dir: str | None = None) -> None:
        from loraplex.adapters.registry_db import RegistryDB

        self.data_dir = data_dir
        self.model_dir = model_dir
        data_dir.mkdir(parents=True, exist_ok=True)
        self.db = RegistryDB.in_dir(str(data_dir))

    @contextmanager
    def _writing(self) -> Iterator[None]:
        from loraplex.adapters.data_dir import DataDirLock, DataDirLockedError
        from loraplex.adapters.registry_db import RegistryError

        try:
            with DataDirLock(self.data_dir):
                yield
        except DataDirLockedError as err:
            raise AdminError(f"{err}; a running server is changed through its admin API (--url)") from None
        except (RegistryError, ValueError) as err:
            raise AdminError(str(err)) from None

    def register(self, name: str, source: str, **fields: Any) -> Any:  # noqa: ANN401
        from loraplex.adapters.base_identity import directory_identity
        from loraplex.adapters.control_plane import ControlPlane
        from loraplex.adapters.sources import SourcePolicy
        from loraplex.adapters.store import AdapterStore
        from loraplex.config import LoRAConfig, ModelConfig
        from loraplex.demo import DEMO_MODEL_DIR
        from loraplex.server.admin_ops import record_json
        from loraplex.server.control import BASE_CACHE

        model_dir = self.model_dir or str(DEMO_MODEL_DIR)
        model = ModelConfig.from_dir(model_dir)
        with self._writing():
            plane = ControlPlane(
                self.db,
                AdapterStore(self.data_dir / "store"),
                SourcePolicy(roots=(Path(source),)),
                model,
                LoRAConfig().max_rank,
                self.data_dir / "staging",
                directory_identity(model_dir, self.data_dir / BASE_CACHE),
            )
            reg = plane.register(
                name,
                source,
                OFFLINE,
                fields.get("sha256"),
                fields.get("tenant") or "default",
                fields.get("visibility") or "private",
            )
            rec = self.db.get(name, reg.revision)
            assert rec is not None
            # no engine here: what the device budget allows is checked by the server that loads it
            return {**record_json(rec, full=True), "created": reg.created, "warnings": []}

    def adapters(self, include_retired: bool) -> Any:  # noqa: ANN401
        from loraplex.server.admin_ops import record_json

        return [record_json(r) for r in self.db.list_adapters(include_retired=include_retired)]

    def adapter(self, name: str) -> Any:  # noqa: ANN401
        from loraplex.server.admin_ops import adapter_detail

        detail = adapter_detail(self.db, name)
        if detail is None:
            raise AdminError(f"unknown adapter {name!r}")
        return detail

    def alias(self, alias: str, target: str) -> Any:  # noqa: ANN401
        with self._writing():
            if "@" not in target:
                raise ValueError(f"target must be name@revision, got {target!r}")
            rec = self.db.resolve(target)
            self.db.set_alias(alias, rec.name, rec.revision, OFFLINE)
            return {"alias": alias, "target": f"{rec.name}@{rec.revision}"}

    def retire(self, spec: str) -> Any:  # noqa: ANN401
        # No server runs, so no request is in flight: the revision is retired at once.
        with self._writing():
            if "@" not in spec:
                raise ValueError(f"retire takes name@revision, got {spec!r}")
            rec = self.db.resolve(spec)
            self.db.set_state(rec.name, rec.revision, "retired", OFFLINE)
            return {"name": rec.name, "revision": rec.revision, "state": "retired"}

    def create_tenant(self, name: str, quotas: dict[str, int]) -> Any:  # noqa: ANN401
        from loraplex.server.limits import TenantQuotas

        with self._writing():
            TenantQuotas.from_mapping(quotas)  # refuse an unknown or non-positive quota first
            self.db.create_tenant(name, quotas, OFFLINE)
            return {"name": name, "quotas": quotas}

    def tenants(self) -> Any:  # noqa: ANN401
        residency = self.db.residency()
        return [
            {"name": n, "quotas": q, "residency": residency.get(n, {})} for n, q in self.db.tenants().items()
        ]

    def set_residency(self, name: str, update: dict[str, Any]) -> Any:  # noqa: ANN401
        from loraplex.adapters.tenant_residency import effective, limits_from_record, merged

        with self._writing():  # an InvalidLimit (a ValueError) names the field
            record = merged(self.db.residency().get(name, {}), update)
            self.db.set_residency(name, record, OFFLINE)
            return {"name": name, "residency": record, "effective": effective(limits_from_record(record))}

    def create_key(self, role: str, tenant: str | None, label: str) -> Any:  # noqa: ANN401
        from loraplex.adapters.registry_db import hash_key

        with self._writing():
            token = self.db.create_key(role, tenant or "default", label, OFFLINE)
            key_id = hash_key(token)[:16]
            return {
                "token": token,
                "key_id": key_id,
                "role": role,
                "tenant": tenant or "default",
                "label": label,
            }

    def keys(self) -> Any:  # noqa: ANN401
        from loraplex.server.admin_ops import key_list

        return key_list(self.db)

    def revoke_key(self, key_id: str) -> Any:  # noqa: ANN401
        from loraplex.server.admin_ops import find_key

        with self._writing():
            key_hash = find_key(self.db, key_id)
            if key_hash is None:
                raise ValueError(f"no live key {key_id!r} (give at least 8 characters of its key_id)")
            self.db.revoke_key(key_hash, OFFLINE)
            return {"key_id": key_hash[:16], "revoked": True}
