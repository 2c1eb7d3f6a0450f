"""The key table: open only while no key was ever configured; revoking the last key locks it."""

from __future__ import annotations

from loraplex.server.auth import ANONYMOUS, KeyTable, Principal, token_hash


def test_revoking_every_key_does_not_open_the_server() -> None:
    table = KeyTable()
    assert not table and table.authenticate("") is ANONYMOUS
    admin = Principal("admin", "default", "ops")
    table.add(token_hash("t1"), admin)
    assert table.authenticate("Bearer t1") == admin and table.authenticate("") is None
    table.remove(token_hash("t1"))
    assert table and table.authenticate("Bearer t1") is None and table.authenticate("") is None
