"""The persistent adapter registry: what exists, who may use it, and every control-plane action.

SQLAlchemy Core over SQLite by default (a file under the data directory, in WAL mode, so readers
never block the one writer), written in portable Core so that a PostgreSQL URL works with the same
code (see docs/architecture.md for why Core and not plain sqlite3). Tables:

    adapters   (name, revision) -> manifest, provenance, tenant, visibility, state, created_*
    aliases    alias -> name@revision (repointed in one statement)
    tenants    name -> quotas, residency limits (device budget, guarantees, priority, cold loads)
    api_keys   sha256 of the token -> role (data | admin), tenant; the token is never stored
    audit_log  append-only: who did what, when, with what result and why it was refused

The schema carries a version; opening a file of an older version runs the migration steps in
order, in one transaction (`registry_schema.open_database`). Revisions are immutable: a row's
manifest never changes; only its state (active -> draining -> retired) moves. This module knows
no tensors and no torch.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import secrets
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from sqlalchemy import Table, func, insert, select, update
from sqlalchemy.engine import Connection, Engine

from loraplex.adapters.registry_schema import (
    DEFAULT_TENANT,
    MIGRATIONS,
    ROLES,
    SCHEMA_VERSION,
    STATES,
    VISIBILITIES,
    RegistryError,
    adapters,
    aliases,
    api_keys,
    audit_log,
    fit,
    open_database,
    schema_info,
    tenants,
    utc_now,
)

__all__ = [  # the tables and constants are part of this module's interface
    "DEFAULT_TENANT",
    "MIGRATIONS",
    "SCHEMA_VERSION",
    "AdapterRecord",
    "KeyRecord",
    "RegistryDB",
    "RegistryError",
    "adapters",
    "aliases",
    "api_keys",
    "audit_log",
    "hash_key",
    "tenants",
]


@dataclass(frozen=True)
class AdapterRecord:
    name: str
    revision: str
    manifest: dict[str, Any]
    provenance: dict[str, Any]
    tenant: str
    visibility: str
    state: str
    created_at: dt.datetime
    created_by: str


@dataclass(frozen=True)
class KeyRecord:
    key_hash: str
    role: str
    tenant: str
    label: str


def hash_key(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


class RegistryDB:
    def __init__(self, url: str) -> None:
        self.engine: Engine = open_database(url)

    @classmethod
    def in_dir(cls, data_dir: str) -> RegistryDB:
        return cls(f"sqlite:///{data_dir}/registry.sqlite")

    def close(self) -> None:
        self.engine.dispose()

    # --- schema ---------------------------------------------------------------------------------

    @property
    def schema_version(self) -> int:
        with self.engine.connect() as conn:
            return int(conn.execute(select(schema_info.c.version)).scalar_one())

    @contextmanager
    def _write(self) -> Iterator[Connection]:
        with self.engine.begin() as conn:
            yield conn

    # --- adapters -------------------------------------------------------------------------------

    def add_revision(
        self,
        name: str,
        revision: str,
        manifest: dict[str, Any],
        provenance: dict[str, Any],
        principal: str,
        tenant: str = DEFAULT_TENANT,
        visibility: str = "private",
    ) -> bool:
        """Record an immutable revision under `name`; False (and no new row) when it is already
        there: registering identical content again is idempotent."""
        if visibility not in VISIBILITIES:
            raise RegistryError(f"visibility must be one of {VISIBILITIES}, got {visibility!r}")
        target = f"{name}@{revision}"
        with self._write() as conn:
            if conn.execute(select(tenants.c.name).where(tenants.c.name == tenant)).first() is None:
                refused = f"unknown tenant {tenant!r}"
            else:
                refused = None
        if refused is not None:
            self._refuse(principal, "register", target, refused)
        with self._write() as conn:
            key = (adapters.c.name == name) & (adapters.c.revision == revision)
            if conn.execute(select(adapters.c.name).where(key)).first() is not None:
                self._audit(conn, principal, "register", target, "exists", None)
                return False
            conn.execute(
                insert(adapters).values(
                    name=name,
                    revision=revision,
                    manifest=manifest,
                    provenance=provenance,
                    tenant=tenant,
                    visibility=visibility,
                    state="active",
                    created_at=utc_now(),
                    created_by=fit(principal, adapters.c.created_by),
                )
            )
            self._audit(conn, principal, "register", target, "ok", None)
        return True

    def get(self, name: str, revision: str) -> AdapterRecord | None:
        with self.engine.connect() as conn:
            row = conn.execute(
                select(adapters).where((adapters.c.name == name) & (adapters.c.revision == revision))
            ).first()
        return None if row is None else AdapterRecord(**row._mapping)

    def list_adapters(self, include_retired: bool = False) -> list[AdapterRecord]:
        query = select(adapters).order_by(adapters.c.created_at, adapters.c.name)
        if not include_retired:
            query = query.where(adapters.c.state != "retired")
        with self.engine.connect() as conn:
            return [AdapterRecord(**row._mapping) for row in conn.execute(query)]

    def resolve(self, spec: str) -> AdapterRecord:
        """An alias, a name (its newest active revision) or `name@revision` (a unique prefix)."""
        with self.engine.connect() as conn:
            alias = conn.execute(select(aliases).where(aliases.c.alias == spec)).first()
            if alias is not None:
                name, prefix = alias.name, alias.revision
            else:
                name, _, prefix = spec.partition("@")
                if "@" in spec and not prefix:
                    raise RegistryError(f"{spec!r}: the revision after '@' is empty")
            query = select(adapters).where(adapters.c.name == name)
            if prefix:
                query = query.where(adapters.c.revision.startswith(prefix, autoescape=True))
            else:
                query = query.where(adapters.c.state == "active").order_by(adapters.c.created_at.desc())
            rows = conn.execute(query).fetchall()
        if not rows:
            raise RegistryError(f"unknown adapter {spec!r}")
        if prefix and len(rows) > 1:
            raise RegistryError(f"ambiguous revision {prefix!r} of adapter {name!r}")
        return AdapterRecord(**rows[0]._mapping)

    def set_state(self, name: str, revision: str, state: str, principal: str) -> None:
        """Move a revision along active -> draining -> retired (never back: revisions are immutable
        and a retired one stays retired)."""
        if state not in STATES:
            raise RegistryError(f"state must be one of {STATES}, got {state!r}")
        target = f"{name}@{revision}"
        with self._write() as conn:
            key = (adapters.c.name == name) & (adapters.c.revision == revision)
            current = conn.execute(select(adapters.c.state).where(key)).scalar_one_or_none()
            why = None
            if current is None or STATES.index(state) < STATES.index(current):
                why = "unknown revision" if current is None else f"cannot go from {current} to {state}"
            else:
                conn.execute(update(adapters).where(key).values(state=state))
                self._audit(conn, principal, f"state:{state}", target, "ok", None)
        if why is not None:
            self._refuse(principal, f"state:{state}", target, why, f"{target}: {why}")

    # --- aliases --------------------------------------------------------------------------------

    def set_alias(self, alias: str, name: str, revision: str, principal: str) -> None:
        """Point `alias` at an active revision, in one statement (a resolve sees the old target or
        the new one, never neither)."""
        target = f"{alias} -> {name}@{revision}"
        with self._write() as conn:
            key = (adapters.c.name == name) & (adapters.c.revision == revision)
            state = conn.execute(select(adapters.c.state).where(key)).scalar_one_or_none()
            why = None
            if state != "active":
                why = "unknown revision" if state is None else f"the revision is {state}"
            else:
                values = {
                    "name": name,
                    "revision": revision,
                    "updated_at": utc_now(),
                    "updated_by": fit(principal, aliases.c.updated_by),
                }
                changed = conn.execute(
                    update(aliases).where(aliases.c.alias == alias).values(**values)
                ).rowcount
                if not changed:
                    conn.execute(insert(aliases).values(alias=alias, **values))
                self._audit(conn, principal, "alias", target, "ok", None)
        if why is not None:
            self._refuse(principal, "alias", target, why, f"alias {alias!r}: {why}")

    def aliases(self) -> dict[str, tuple[str, str]]:
        """alias -> (name, revision)."""
        with self.engine.connect() as conn:
            return {row.alias: (row.name, row.revision) for row in conn.execute(select(aliases))}

    # --- tenants and keys -------------------------------------------------------------------------

    def create_tenant(
        self, name: str, quotas: dict[str, int], principal: str, residency: dict[str, Any] | None = None
    ) -> None:
        """`residency`: the stored form of its residency limits (`tenant_residency.record_of`)."""
        with self._write() as conn:
            exists = conn.execute(select(tenants.c.name).where(tenants.c.name == name)).first() is not None
            if not exists:
                conn.execute(
                    insert(tenants).values(
                        name=name, quotas=quotas, residency=residency or {}, created_at=utc_now()
                    )
                )
                self._audit(conn, principal, "tenant", name, "ok", None)
        if exists:
            self._refuse(principal, "tenant", name, "exists", f"tenant {name!r} exists")

    def residency(self) -> dict[str, dict[str, Any]]:
        """tenant -> its stored residency limits ({} when none is set)."""
        query = select(tenants.c.name, tenants.c.residency).order_by(tenants.c.name)
        with self.engine.connect() as conn:
            return {row.name: dict(row.residency or {}) for row in conn.execute(query)}

    def set_residency(self, name: str, residency: dict[str, Any], principal: str) -> None:
        """Replace a tenant's stored residency limits (validated by the caller)."""
        with self._write() as conn:
            changed = conn.execute(
                update(tenants).where(tenants.c.name == name).values(residency=residency)
            ).rowcount
            if changed:
                self._audit(conn, principal, "residency", name, "ok", None)
        if not changed:
            self._refuse(principal, "residency", name, "unknown tenant", f"unknown tenant {name!r}")

    def tenants(self) -> dict[str, dict[str, int]]:
        """tenant -> its quotas."""
        with self.engine.connect() as conn:
            return {
                row.name: dict(row.quotas) for row in conn.execute(select(tenants).order_by(tenants.c.name))
            }

    def quotas(self, tenant: str) -> dict[str, int]:
        with self.engine.connect() as conn:
            row = conn.execute(select(tenants.c.quotas).where(tenants.c.name == tenant)).first()
        if row is None:
            raise RegistryError(f"unknown tenant {tenant!r}")
        return dict(row.quotas)

    def create_key(self, role: str, tenant: str, label: str, principal: str) -> str:
        """A new random token (256 bits), returned once; only its sha256 is stored."""
        if role not in ROLES:
            raise RegistryError(f"role must be one of {ROLES}, got {role!r}")
        token = "lpx-" + secrets.token_urlsafe(32)
        with self._write() as conn:
            known = conn.execute(select(tenants.c.name).where(tenants.c.name == tenant)).first() is not None
            if known:
                conn.execute(
                    insert(api_keys).values(
                        key_hash=hash_key(token), role=role, tenant=tenant, label=label, created_at=utc_now()
                    )
                )
                self._audit(conn, principal, "key", f"{role} key {label!r} of {tenant}", "ok", None)
        if not known:
            self._refuse(principal, "key", f"{role} key {label!r}", f"unknown tenant {tenant!r}")
        return token

    def revoke_key(self, key_hash: str, principal: str) -> None:
        with self._write() as conn:
            changed = conn.execute(
                update(api_keys)
                .where((api_keys.c.key_hash == key_hash) & api_keys.c.revoked_at.is_(None))
                .values(revoked_at=utc_now())
            ).rowcount
            if changed:
                self._audit(conn, principal, "revoke", key_hash[:12], "ok", None)
        if not changed:
            self._refuse(
                principal, "revoke", key_hash[:12], "no such live key", f"no live key {key_hash[:12]}..."
            )

    def live_keys(self) -> dict[str, KeyRecord]:
        """sha256 -> key, for checking tokens from memory (no query per request)."""
        query = select(api_keys).where(api_keys.c.revoked_at.is_(None))
        with self.engine.connect() as conn:
            return {
                row.key_hash: KeyRecord(row.key_hash, row.role, row.tenant, row.label)
                for row in conn.execute(query)
            }

    # --- audit ----------------------------------------------------------------------------------

    def _audit(
        self, conn: Connection, principal: str, action: str, target: str, result: str, reason: str | None
    ) -> None:
        conn.execute(
            insert(audit_log).values(
                at=utc_now(),
                principal=fit(principal, audit_log.c.principal),
                action=fit(action, audit_log.c.action),
                target=fit(target, audit_log.c.target),
                result=result,
                reason=None if reason is None else fit(reason, audit_log.c.reason),
            )
        )

    def record_refusal(self, principal: str, action: str, target: str, reason: str) -> None:
        """Audit a control-plane action refused before it reached the registry (a bad source, a
        checksum mismatch, an adapter that cannot be served)."""
        with self._write() as conn:
            self._audit(conn, principal, action, target, "refused", reason)

    def _refuse(
        self, principal: str, action: str, target: str, reason: str, message: str | None = None
    ) -> None:
        """Record a refusal in its own transaction (the refused one wrote nothing) and raise it."""
        with self._write() as conn:
            self._audit(conn, principal, action, target, "refused", reason)
        raise RegistryError(message or reason)

    def audit(self, offset: int = 0, limit: int = 100) -> list[dict[str, Any]]:
        query = select(audit_log).order_by(audit_log.c.id).offset(offset).limit(limit)
        with self.engine.connect() as conn:
            return [dict(row._mapping) for row in conn.execute(query)]

    def count(self, table: Table) -> int:
        with self.engine.connect() as conn:
            return int(conn.execute(select(func.count()).select_from(table)).scalar_one())
