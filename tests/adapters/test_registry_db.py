"""The persistent registry on its own: a real SQLite file (WAL) that survives reopening, immutable
revisions with idempotent re-registration, aliases, states, tenants, hashed keys, an append-only
audit log, schema migration from an older file, and the data directory's one-writer lock."""

from __future__ import annotations

import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("sqlalchemy")  # a server-side package: the GPU machine's image lacks it

from sqlalchemy import text  # noqa: E402

from loraplex.adapters import registry_db as rdb  # noqa: E402
from loraplex.adapters import registry_schema as schema  # noqa: E402
from loraplex.adapters.data_dir import DataDirLock, DataDirLockedError  # noqa: E402
from loraplex.adapters.registry_db import RegistryDB, RegistryError, hash_key  # noqa: E402

REV_A, REV_B = "a" * 64, "b" * 64


def test_survives_reopening_and_is_idempotent(tmp_path: Path) -> None:
    db = RegistryDB.in_dir(str(tmp_path))
    assert db.add_revision("sql", REV_A, {"r": 16}, {"source": "/x"}, principal="admin")
    assert not db.add_revision("sql", REV_A, {"r": 16}, {"source": "/y"}, principal="admin")
    assert db.add_revision("sql", REV_B, {"r": 8}, {}, principal="admin")
    db.close()
    mode = sqlite3.connect(tmp_path / "registry.sqlite").execute("PRAGMA journal_mode").fetchone()[0]
    assert mode == "wal"
    again = RegistryDB.in_dir(str(tmp_path))
    assert [(r.name, r.revision) for r in again.list_adapters()] == [("sql", REV_A), ("sql", REV_B)]
    assert again.resolve("sql").revision == REV_B  # the newest active revision
    assert again.resolve("sql@aaaa").manifest == {"r": 16}
    assert again.get("sql", REV_A).provenance == {"source": "/x"}  # the first registration's
    for bad in ("nope", "sql@", "sql@cccc"):
        with pytest.raises(RegistryError):
            again.resolve(bad)


def test_aliases_states_and_the_audit_log(tmp_path: Path) -> None:
    db = RegistryDB.in_dir(str(tmp_path))
    db.add_revision("support", REV_A, {}, {}, principal="ops")
    db.add_revision("support", REV_B, {}, {}, principal="ops")
    db.set_alias("support/latest", "support", REV_A, principal="ops")
    assert db.resolve("support/latest").revision == REV_A
    db.set_alias("support/latest", "support", REV_B, principal="ops")
    assert db.resolve("support/latest").revision == REV_B
    db.set_state("support", REV_A, "draining", principal="ops")
    with pytest.raises(RegistryError, match="draining"):
        db.set_alias("support/latest", "support", REV_A, principal="ops")
    db.set_state("support", REV_A, "retired", principal="ops")
    with pytest.raises(RegistryError, match="cannot go from retired to active"):
        db.set_state("support", REV_A, "active", principal="ops")
    assert [r.revision for r in db.list_adapters()] == [REV_B]
    assert len(db.list_adapters(include_retired=True)) == 2
    log = db.audit()
    assert [(e["action"], e["result"]) for e in log] == [
        ("register", "ok"),
        ("register", "ok"),
        ("alias", "ok"),
        ("alias", "ok"),
        ("state:draining", "ok"),
        ("alias", "refused"),
        ("state:retired", "ok"),
        ("state:active", "refused"),
    ]
    assert all(e["principal"] == "ops" for e in log) and log[5]["reason"] == "the revision is draining"
    assert db.audit(offset=6, limit=1)[0]["action"] == "state:retired"


def test_tenants_and_keys_are_stored_hashed(tmp_path: Path) -> None:
    db = RegistryDB.in_dir(str(tmp_path))
    db.create_tenant("acme", {"max_adapters": 10, "max_rank": 32}, principal="root")
    assert db.quotas("acme") == {"max_adapters": 10, "max_rank": 32}
    with pytest.raises(RegistryError, match="exists"):
        db.create_tenant("acme", {}, principal="root")
    token = db.create_key("data", "acme", "ci", principal="root")
    admin = db.create_key("admin", "default", "ops", principal="root")
    keys = db.live_keys()
    assert set(keys) == {hash_key(token), hash_key(admin)} and keys[hash_key(token)].tenant == "acme"
    raw = (tmp_path / "registry.sqlite").read_bytes() + (tmp_path / "registry.sqlite-wal").read_bytes()
    assert token.encode() not in raw and admin.encode() not in raw  # never stored in clear
    db.revoke_key(hash_key(token), principal="root")
    assert set(db.live_keys()) == {hash_key(admin)}
    with pytest.raises(RegistryError):
        db.revoke_key(hash_key(token), principal="root")
    refusals = [e for e in db.audit() if e["result"] == "refused"]
    assert [(e["action"], e["reason"]) for e in refusals] == [
        ("tenant", "exists"),
        ("revoke", "no such live key"),
    ]
    with pytest.raises(RegistryError, match="unknown tenant"):
        db.add_revision("x", REV_A, {}, {}, principal="root", tenant="nobody")
    assert db.count(rdb.adapters) == 0  # a refused registration leaves no row


def test_migrates_an_older_file_and_refuses_a_newer_one(tmp_path: Path, monkeypatch) -> None:  # noqa: ANN001
    db = RegistryDB.in_dir(str(tmp_path))
    db.add_revision("sql", REV_A, {"r": 16}, {}, principal="admin")
    db.close()

    # A later release adds a column; opening the current version's file upgrades it in place.
    current = rdb.SCHEMA_VERSION

    def to_next(conn) -> None:  # noqa: ANN001
        conn.execute(text("ALTER TABLE adapters ADD COLUMN note VARCHAR(64) DEFAULT ''"))

    monkeypatch.setattr(schema, "SCHEMA_VERSION", current + 1)
    monkeypatch.setitem(rdb.MIGRATIONS, current, to_next)
    upgraded = RegistryDB.in_dir(str(tmp_path))
    assert upgraded.schema_version == current + 1 and upgraded.resolve("sql").manifest == {"r": 16}
    cols = [
        row[1] for row in sqlite3.connect(tmp_path / "registry.sqlite").execute("PRAGMA table_info(adapters)")
    ]
    assert "note" in cols
    upgraded.close()
    monkeypatch.setattr(schema, "SCHEMA_VERSION", current)
    with pytest.raises(RegistryError, match="newer than this loraplex"):
        RegistryDB.in_dir(str(tmp_path))


def test_one_writer_per_data_directory(tmp_path: Path) -> None:
    with DataDirLock(tmp_path):
        code = (
            "import sys; from loraplex.adapters.data_dir import DataDirLock, DataDirLockedError\n"
            f"try:\n    DataDirLock({str(tmp_path)!r}).acquire()\nexcept DataDirLockedError as e:\n"
            "    print(e); sys.exit(3)\n"
        )
        other = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
        assert other.returncode == 3 and "in use by process" in other.stdout
    with DataDirLock(tmp_path):  # released on exit, so it can be taken again
        pass
    with DataDirLock(tmp_path), pytest.raises(DataDirLockedError):
        DataDirLock(tmp_path).acquire()  # the same process's second writer too


def test_the_schema_and_queries_compile_for_postgresql() -> None:
    """No PostgreSQL server here: the tables' DDL and the registry's prefix match compile for its
    dialect (the only SQLite-specific code is the pragma hook, attached for sqlite URLs only)."""
    from sqlalchemy import select
    from sqlalchemy.dialects import postgresql
    from sqlalchemy.schema import CreateTable

    dialect = postgresql.dialect()
    for table in schema.metadata.sorted_tables:
        assert "CREATE TABLE" in str(CreateTable(table).compile(dialect=dialect))
    like = select(rdb.adapters).where(rdb.adapters.c.revision.startswith("ab%", autoescape=True))
    assert "LIKE" in str(like.compile(dialect=dialect))


def test_long_texts_fit_their_columns(tmp_path: Path) -> None:
    """PostgreSQL refuses a string longer than its column (SQLite does not): the registry clips
    free text, keeping its head and tail (a principal's key id is its end)."""
    db = RegistryDB.in_dir(str(tmp_path))
    principal = "k" * 300 + "#abcd1234"
    db.record_refusal(principal, "register", "t" * 900, "r" * 3000)
    row = db.audit(limit=10)[-1]
    assert len(row["principal"]) == 128 and row["principal"].endswith("#abcd1234")
    assert len(row["target"]) == 512 and len(row["reason"]) == 2048 and "..." in row["reason"]
    db.close()
