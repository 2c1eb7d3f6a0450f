"""What each admin API call does, as plain functions of the control service: check the request,
write the registry, then change the engine's view (see `control.py`). Writes run on the control
service's one writer thread; reads run on any worker thread. Every refusal is an APIError naming
its reason (400 bad input, 404 unknown, 409 a conflict with what exists, 403/413 a quota); the
registry audits every write and every refusal it sees, with the caller's principal.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from loraplex.adapters.control_plane import RegistrationError
from loraplex.adapters.eviction import InvalidLimit
from loraplex.adapters.registry_db import AdapterRecord, RegistryDB, RegistryError, hash_key
from loraplex.adapters.tenant_residency import effective, limits_from_record, merged
from loraplex.server.auth import Principal
from loraplex.server.control import ControlService, manifest_bytes
from loraplex.server.errors import APIError
from loraplex.server.limits import TenantQuotas
from loraplex.types import ADAPTER_NAME_PATTERN, AdapterRef

_ALIAS = re.compile(r"[A-Za-z0-9][A-Za-z0-9._/-]{0,255}")  # like a name, and '/' (support/latest)
_NAME = re.compile(ADAPTER_NAME_PATTERN)


def not_found(message: str) -> APIError:
    return APIError(404, message, code="not_found")


def conflict(message: str) -> APIError:
    return APIError(409, message, code="conflict")


def record_json(rec: AdapterRecord, full: bool = False) -> dict[str, Any]:
    out: dict[str, Any] = {
        "name": rec.name,
        "revision": rec.revision,
        "tenant": rec.tenant,
        "visibility": rec.visibility,
        "state": rec.state,
        "max_rank": rec.manifest.get("max_rank"),
        "bytes": manifest_bytes(rec.manifest),
        "created_at": rec.created_at.isoformat(),
        "created_by": rec.created_by,
    }
    if full:
        out["manifest"] = rec.manifest
        out["provenance"] = rec.provenance
    return out


def adapter_detail(db: RegistryDB, name: str) -> dict[str, Any] | None:
    """Every revision of `name` (retired ones too) and the aliases pointing at them; None: unknown."""
    revisions = [r for r in db.list_adapters(include_retired=True) if r.name == name]
    if not revisions:
        return None
    aliases = {a: f"{n}@{r}" for a, (n, r) in db.aliases().items() if n == name}
    return {"name": name, "revisions": [record_json(r, full=True) for r in revisions], "aliases": aliases}


def key_list(db: RegistryDB) -> list[dict[str, Any]]:
    """The live keys, by the start of their hash (the token itself is never stored)."""
    return [
        {"key_id": h[:16], "role": k.role, "tenant": k.tenant, "label": k.label}
        for h, k in db.live_keys().items()
    ]


def find_key(db: RegistryDB, key_id: str) -> str | None:
    """The one live key whose hash starts with `key_id` (8 characters at least), else None."""
    matches = [h for h in db.live_keys() if len(key_id) >= 8 and h.startswith(key_id.lower())]
    return matches[0] if len(matches) == 1 else None


def _residency_record(current: dict[str, Any], update: dict[str, Any], prefix: str) -> dict[str, Any]:
    """The stored record after `update`; a 400 naming the field (`prefix` + its name) otherwise."""
    try:
        return merged(current, update)
    except InvalidLimit as err:
        raise APIError(400, str(err), param=prefix + err.field) from None


class AdminOps:
    def __init__(self, control: ControlService) -> None:
        self.control = control
        self.db = control.db

    @contextmanager
    def _audited(self, who: Principal, action: str, target: str) -> Iterator[None]:
        """Audit a refusal raised by the checks inside (those the registry never saw)."""
        try:
            yield
        except APIError as err:
            self.db.record_refusal(who.label, action, target, err.message)
            raise

    # --- adapters -------------------------------------------------------------------------------

    def register(
        self,
        who: Principal,
        name: str,
        source: str,
        sha256: str | None,
        tenant: str | None,
        visibility: str,
    ) -> dict[str, Any]:
        tenant = tenant or who.tenant
        with self._audited(who, "register", f"{name} from {source}"):
            if tenant not in self.control.quotas:
                raise not_found(f"unknown tenant {tenant!r}")
            owners = {r.tenant for r in self.db.list_adapters(include_retired=True) if r.name == name}
            if owners - {tenant}:
                raise conflict(f"adapter name {name!r} belongs to another tenant")
            if name in self.db.aliases():
                raise conflict(f"{name!r} is an alias; an adapter cannot take its name")
            if name == self.control.served_model:
                raise conflict(f"{name!r} is the base model's name")
        try:
            reg = self.control.plane.register(
                name,
                source,
                who.label,
                sha256,
                tenant,
                visibility,
                check=self.control.quota_check(tenant),
            )
        except RegistrationError as err:
            raise APIError(err.status, str(err), code="registration_refused") from None
        rec = self.db.get(name, reg.revision)
        assert rec is not None
        if reg.created:
            try:
                self.control.serve_revision(rec)
            except Exception as err:  # recorded but not servable here: take it out of service again
                self.db.set_state(name, reg.revision, "retired", who.label)
                raise APIError(500, f"registered but could not be loaded: {err}") from None
        # the operator who registers it is the one who should learn that its requests are refused
        warning = self.control.on_engine(lambda e: e.tiers.registration_warning(rec.revision))
        warnings = [] if warning is None else [warning]
        return {**record_json(rec, full=True), "created": reg.created, "warnings": warnings}

    def adapters(self, include_retired: bool) -> list[dict[str, Any]]:
        return [record_json(r) for r in self.db.list_adapters(include_retired=include_retired)]

    def adapter(self, name: str) -> dict[str, Any]:
        detail = adapter_detail(self.db, name)
        if detail is None:
            raise not_found(f"unknown adapter {name!r}")
        return detail

    def retire(self, who: Principal, name: str, revision: str) -> dict[str, Any]:
        with self._audited(who, "state:draining", f"{name}@{revision}"):
            rec = self._resolve(f"{name}@{revision}")
            if rec.state != "active":
                raise conflict(f"{rec.name}@{rec.revision[:12]} is already {rec.state}")
        self.db.set_state(rec.name, rec.revision, "draining", who.label)
        ref = AdapterRef(rec.name, rec.revision)

        def retire(engine: Any) -> int:  # noqa: ANN401  (the engine, on its own thread)
            holds = int(engine.adapters.holds(ref))
            engine.retire_adapter(ref)
            return holds

        in_flight = self.control.on_engine(retire)
        return {"name": rec.name, "revision": rec.revision, "state": "draining", "in_flight": in_flight}

    # --- aliases --------------------------------------------------------------------------------

    def alias(self, who: Principal, alias: str, target: str) -> dict[str, Any]:
        with self._audited(who, "alias", f"{alias} -> {target}"):
            if not _ALIAS.fullmatch(alias):
                raise APIError(
                    400,
                    f"invalid alias {alias!r}: letters, digits, '.', '_', '-' and '/', at most 256",
                    param="alias",
                )
            if "@" not in target:
                raise APIError(400, f"target must be name@revision, got {target!r}", param="target")
            if any(r.name == alias for r in self.db.list_adapters(include_retired=True)):
                raise conflict(f"{alias!r} is an adapter's name; an alias cannot take it")
            if alias == self.control.served_model:
                raise conflict(f"{alias!r} is the base model's name")
            rec = self._resolve(target)
            if rec.state != "active":
                raise conflict(f"{rec.name}@{rec.revision[:12]} is {rec.state}; an alias needs an active one")
        previous = self.db.aliases().get(alias)
        try:
            self.db.set_alias(alias, rec.name, rec.revision, who.label)
        except RegistryError as err:
            raise conflict(str(err)) from None
        ref = AdapterRef(rec.name, rec.revision)
        self.control.on_engine(lambda e: e.adapters.set_alias(alias, ref))
        return {
            "alias": alias,
            "target": str(ref),
            "previous": None if previous is None else f"{previous[0]}@{previous[1]}",
        }

    def _resolve(self, spec: str) -> AdapterRecord:
        try:
            return self.db.resolve(spec)
        except RegistryError as err:
            raise not_found(str(err)) from None

    # --- tenants and keys -------------------------------------------------------------------------

    def create_tenant(
        self, who: Principal, name: str, quotas: dict[str, Any], residency: dict[str, Any]
    ) -> dict[str, Any]:
        with self._audited(who, "tenant", name):
            if not _NAME.fullmatch(name) or len(name) > 128:
                raise APIError(400, f"invalid tenant name {name!r}", param="name")
            try:
                parsed = TenantQuotas.from_mapping(quotas)
            except (TypeError, ValueError) as err:
                raise APIError(400, str(err), param="quotas") from None
            record = _residency_record({}, residency, "residency.")
            if name in self.control.quotas:
                raise conflict(f"tenant {name!r} exists")
            self.control.check_guarantees(name, limits_from_record(record))
        stored = {k: v for k, v in quotas.items() if v is not None}
        try:
            self.db.create_tenant(name, stored, who.label, record)
        except RegistryError as err:
            raise conflict(str(err)) from None
        self.control.quotas[name] = parsed
        self.control.set_residency(name, limits_from_record(record))
        return {"name": name, "quotas": stored, "residency": record}

    def tenants(self) -> list[dict[str, Any]]:
        residency = self.db.residency()
        return [
            {"name": n, "quotas": q, "residency": residency.get(n, {})} for n, q in self.db.tenants().items()
        ]

    def set_residency(self, who: Principal, tenant: str, update: dict[str, Any]) -> dict[str, Any]:
        """Change some of a tenant's residency limits (a null resets one to its default); the
        engine enforces them from its next step."""
        with self._audited(who, "residency", tenant):
            if tenant not in self.control.quotas:
                raise not_found(f"unknown tenant {tenant!r}")
            record = _residency_record(self.db.residency().get(tenant, {}), update, "")
            limits = limits_from_record(record)
            self.control.check_guarantees(tenant, limits)
        self.db.set_residency(tenant, record, who.label)
        self.control.set_residency(tenant, limits)
        return {"name": tenant, "residency": record, "effective": effective(limits)}

    def create_key(self, who: Principal, role: str, tenant: str | None, label: str) -> dict[str, Any]:
        tenant = tenant or who.tenant
        with self._audited(who, "key", f"{role} key {label!r}"):
            if tenant not in self.control.quotas:
                raise not_found(f"unknown tenant {tenant!r}")
        try:
            token = self.db.create_key(role, tenant, label, who.label)
        except RegistryError as err:
            raise APIError(400, str(err)) from None
        key_hash = hash_key(token)
        self.control.keys.add(key_hash, Principal(role, tenant, f"{label}#{key_hash[:8]}"))
        return {"token": token, "key_id": key_hash[:16], "role": role, "tenant": tenant, "label": label}

    def keys(self) -> list[dict[str, Any]]:
        return key_list(self.db)

    def revoke_key(self, who: Principal, key_id: str) -> dict[str, Any]:
        key_hash = find_key(self.db, key_id)
        with self._audited(who, "revoke", key_id[:64]):
            if key_hash is None:
                raise not_found(f"no live key {key_id!r} (give at least 8 characters of its key_id)")
        self.db.revoke_key(key_hash, who.label)
        self.control.keys.remove(key_hash)
        return {"key_id": key_hash[:16], "revoked": True}

    def audit(self, offset: int, limit: int) -> dict[str, Any]:
        if offset < 0 or not 1 <= limit <= 1000:
            raise APIError(400, "offset must be >= 0 and limit in [1, 1000]", param="limit")
        rows = self.db.audit(offset, limit)
        for row in rows:
            row["at"] = row["at"].isoformat()
        more = len(rows) == limit
        return {"entries": rows, "offset": offset, "next_offset": offset + len(rows) if more else None}
