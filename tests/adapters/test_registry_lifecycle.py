"""The engine's registry beyond names and revisions: aliases, retirement with holds, and what each
tenant may see (no model, no torch)."""

from __future__ import annotations

import pytest

from loraplex.adapters.registry import AdapterRegistry, RetiredAdapterError, UnknownAdapterError
from loraplex.types import AdapterRef

REV_A, REV_B = "a" * 64, "b" * 64


def test_aliases_repoint_and_refuse_what_is_not_live() -> None:
    reg = AdapterRegistry()
    a = reg.add("sql", REV_A, 8, 10, {})
    b = reg.add("sql", REV_B, 8, 10, {})
    reg.set_alias("sql/stable", a)
    assert reg.acquire("sql/stable") == a
    reg.set_alias("sql/stable", b)
    assert reg.resolve("sql/stable").ref == b and reg.holds(a) == 1  # the held one keeps its revision
    with pytest.raises(UnknownAdapterError):
        reg.set_alias("x", AdapterRef("nope", REV_A))
    with pytest.raises(ValueError, match="an adapter's name"):
        reg.set_alias("sql", a)


def test_retire_drains_and_the_name_falls_back() -> None:
    reg = AdapterRegistry()
    a = reg.add("sql", REV_A, 8, 10, {})
    b = reg.add("sql", REV_B, 8, 10, {})
    held = reg.acquire("sql")
    assert held == b
    assert reg.retire(b) is False  # a request holds it
    assert reg.latest("sql") == a  # the name's newest live revision
    with pytest.raises(RetiredAdapterError, match="retired"):
        reg.acquire(f"sql@{REV_B[:8]}")
    assert reg.release(held) is True  # the last hold of a retired revision: free it now
    assert reg.in_service(REV_B) is False and reg.in_service(REV_A) is True
    assert reg.retire(a) is True
    with pytest.raises(RetiredAdapterError, match="every revision"):
        reg.acquire("sql")
    assert reg.list_latest() == []
    with pytest.raises(ValueError, match="retired"):
        reg.add("sql", REV_A, 8, 10, {})


def test_a_tenant_sees_its_own_and_shared_revisions_only() -> None:
    reg = AdapterRegistry()
    reg.add("mine", REV_A, 8, 10, {}, tenant="acme", visibility="private")
    reg.add("ours", REV_B, 8, 10, {}, tenant="acme", visibility="shared")
    reg.set_alias("mine/latest", AdapterRef("mine", REV_A))
    assert [e.ref.name for e in reg.list_latest("acme")] == ["mine", "ours"]
    assert [e.ref.name for e in reg.list_latest("globex")] == ["ours"]
    assert list(reg.aliases("acme")) == ["mine/latest"] and reg.aliases("globex") == {}
    for spec in ("mine", f"mine@{REV_A[:8]}", "mine/latest"):
        assert reg.resolve(spec, "acme").ref.name == "mine"
        with pytest.raises(UnknownAdapterError) as hidden:
            reg.resolve(spec, "globex")
        assert type(hidden.value) is UnknownAdapterError  # not "retired", not "forbidden": unknown
        assert "unknown adapter" in str(hidden.value)
    assert reg.resolve("mine").ref.name == "mine"  # no tenant: the engine's own callers see all
