"""The persistent registry's tables, in portable SQLAlchemy Core (SQLite and PostgreSQL).

Every string column has a length; SQLite ignores it, PostgreSQL refuses a longer value, so the
registry clips what it writes into free-text columns (`fit`) instead of failing on PostgreSQL
only. `registry_db.py` reads and writes them; `open_database` here creates them, or brings an
older file's up to this version, before anything reads them.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Callable
from typing import Any

from sqlalchemy import (
    JSON,
    Column,
    DateTime,
    ForeignKey,
    Integer,
    MetaData,
    PrimaryKeyConstraint,
    String,
    Table,
    create_engine,
    event,
    insert,
    inspect,
    select,
    text,
    update,
)
from sqlalchemy.engine import Connection, Engine

SCHEMA_VERSION = 2
STATES = ("active", "draining", "retired")
VISIBILITIES = ("private", "shared")
ROLES = ("data", "admin")
DEFAULT_TENANT = "default"


class RegistryError(ValueError):
    """A control-plane request the registry refuses (the message names why)."""


def utc_now() -> dt.datetime:
    return dt.datetime.now(dt.UTC)


metadata = MetaData()

schema_info = Table("schema_info", metadata, Column("version", Integer, nullable=False))

tenants = Table(
    "tenants",
    metadata,
    Column("name", String(128), primary_key=True),
    Column("quotas", JSON, nullable=False),
    Column("created_at", DateTime(timezone=True), nullable=False),
    # Residency limits (`adapters/tenant_residency.py`); NULL reads as none set. Nullable so that
    # the version 1 -> 2 step can add it to a table with rows on any database.
    Column("residency", JSON, nullable=True),
)

adapters = Table(
    "adapters",
    metadata,
    Column("name", String(128), nullable=False),
    Column("revision", String(64), nullable=False),
    Column("manifest", JSON, nullable=False),
    Column("provenance", JSON, nullable=False),
    Column("tenant", String(128), ForeignKey("tenants.name"), nullable=False),
    Column("visibility", String(16), nullable=False),
    Column("state", String(16), nullable=False),
    Column("created_at", DateTime(timezone=True), nullable=False),
    Column("created_by", String(128), nullable=False),
    PrimaryKeyConstraint("name", "revision"),
)

aliases = Table(
    "aliases",
    metadata,
    Column("alias", String(256), primary_key=True),
    Column("name", String(128), nullable=False),
    Column("revision", String(64), nullable=False),
    Column("updated_at", DateTime(timezone=True), nullable=False),
    Column("updated_by", String(128), nullable=False),
)

api_keys = Table(
    "api_keys",
    metadata,
    Column("key_hash", String(64), primary_key=True),
    Column("role", String(8), nullable=False),
    Column("tenant", String(128), ForeignKey("tenants.name"), nullable=False),
    Column("label", String(256), nullable=False),
    Column("created_at", DateTime(timezone=True), nullable=False),
    Column("revoked_at", DateTime(timezone=True), nullable=True),
)

audit_log = Table(
    "audit_log",
    metadata,
    Column("id", Integer, primary_key=True, autoincrement=True),
    Column("at", DateTime(timezone=True), nullable=False),
    Column("principal", String(128), nullable=False),
    Column("action", String(64), nullable=False),
    Column("target", String(512), nullable=False),
    Column("result", String(16), nullable=False),  # ok | exists | refused
    Column("reason", String(2048), nullable=True),
)

# Version 1 kept these two in `quotas`, stored but not enforced; version 2 moves them to `residency`.
_V1_RESIDENCY_QUOTAS = {
    "cold_load_bytes_per_minute": "cold_load_bytes_per_minute",
    "device_residency_bytes": "device_budget_bytes",
}


def _v1_to_v2(conn: Connection) -> None:
    """Add `tenants.residency` and move version 1's residency quotas into it."""
    column = tenants.c.residency
    ddl = column.type.compile(dialect=conn.dialect)
    conn.execute(text(f"ALTER TABLE tenants ADD COLUMN residency {ddl}"))
    for row in conn.execute(select(tenants.c.name, tenants.c.quotas)).fetchall():
        quotas = dict(row.quotas or {})
        moved = {new: quotas.pop(old) for old, new in _V1_RESIDENCY_QUOTAS.items() if old in quotas}
        conn.execute(update(tenants).where(tenants.c.name == row.name).values(quotas=quotas, residency=moved))


# version -> the step that brings a database of that version to the next one
MIGRATIONS: dict[int, Callable[[Connection], None]] = {1: _v1_to_v2}


def fit(text: str, column: Column[str]) -> str:
    """`text` within `column`'s length: the head and the tail kept (a principal's key id is at its
    end), the middle marked as cut."""
    limit = getattr(column.type, "length", None)
    if limit is None or len(text) <= limit:
        return text
    head = (limit - 3) // 2
    return f"{text[:head]}...{text[len(text) - (limit - 3 - head) :]}"


def open_database(url: str) -> Engine:
    """A database engine on `url` whose tables are at this version: created in an empty database
    (with the default tenant), migrated step by step in one transaction from an older version.
    A newer version is refused: this code would misread it."""
    engine = create_engine(url)
    if engine.dialect.name == "sqlite":
        event.listen(engine, "connect", _sqlite_pragmas)
    with engine.begin() as conn:
        if not inspect(conn).has_table("schema_info"):
            metadata.create_all(conn)
            conn.execute(insert(schema_info).values(version=SCHEMA_VERSION))
            conn.execute(
                insert(tenants).values(name=DEFAULT_TENANT, quotas={}, residency={}, created_at=utc_now())
            )
            return engine
        version = conn.execute(select(schema_info.c.version)).scalar_one()
        if version > SCHEMA_VERSION:
            engine.dispose()
            raise RegistryError(
                f"the registry's schema is version {version}, newer than this loraplex's "
                f"{SCHEMA_VERSION}: upgrade loraplex"
            )
        while version < SCHEMA_VERSION:
            MIGRATIONS[version](conn)
            version += 1
            conn.execute(update(schema_info).values(version=version))
    return engine


def _sqlite_pragmas(dbapi_connection: Any, _record: Any) -> None:  # noqa: ANN401
    cursor = dbapi_connection.cursor()
    cursor.execute("PRAGMA journal_mode=WAL")  # readers never block the writer
    cursor.execute("PRAGMA foreign_keys=ON")
    cursor.execute("PRAGMA busy_timeout=5000")
    cursor.close()
