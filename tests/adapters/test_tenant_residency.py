"""Tenant residency limits as the registry stores them: parsing with errors naming the field, the
merge of a partial update, the version 1 -> 2 migration that moves the old residency quotas into
their own record, the guaranteed adapter count in the policy, and the check that all tenants'
guaranteed bytes together fit the device budget."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest

from loraplex.adapters.eviction import (
    Candidate,
    EvictionConfig,
    EvictionPolicy,
    InvalidLimit,
    TenantLimits,
    Tier,
)
from loraplex.adapters.registry_db import RegistryDB
from loraplex.adapters.tenant_residency import (
    guarantee_overcommit,
    limits_from_record,
    merged,
    record_of,
)

MB = 1 << 20


@pytest.mark.parametrize(
    "raw,field,message",
    [
        ({"priority": "high"}, "priority", "priority must be a number"),
        ({"priority": 0}, "priority", "tenant priority must be > 0"),
        ({"guaranteed_bytes": 1.5}, "guaranteed_bytes", "guaranteed_bytes must be an integer"),
        ({"guaranteed_adapters": -1}, "guaranteed_adapters", "guaranteed_adapters must be >= 0"),
        ({"device_budget_bytes": True}, "device_budget_bytes", "must be an integer"),
        ({"cold_load_over_rate": "drop"}, "cold_load_over_rate", "must be one of ('wait', 'refuse')"),
        ({"guaranteed_bytes": 3, "device_budget_bytes": 2}, "guaranteed_bytes", "exceed the device budget"),
        ({"speed": 1}, "speed", "unknown residency limit 'speed'"),
    ],
)
def test_invalid_limits_name_their_field(raw: dict, field: str, message: str) -> None:
    with pytest.raises(InvalidLimit, match=message.replace("(", r"\(").replace(")", r"\)")) as err:
        limits_from_record(raw)
    assert err.value.field == field


def test_partial_updates_merge_and_null_resets() -> None:
    current = record_of(limits_from_record({"priority": 2, "guaranteed_bytes": MB}))
    assert current == {"priority": 2.0, "guaranteed_bytes": MB}  # only what differs from the defaults
    assert merged(current, {"cold_load_bytes_per_minute": 60 * MB}) == {
        **current,
        "cold_load_bytes_per_minute": 60 * MB,
    }
    assert merged(current, {"priority": None}) == {"guaranteed_bytes": MB}
    with pytest.raises(InvalidLimit):  # validated as a whole: the new budget is under the guarantee
        merged(current, {"device_budget_bytes": MB // 2})


def test_version_1_registry_migrates_its_residency_quotas(tmp_path: Path) -> None:
    db = RegistryDB.in_dir(str(tmp_path))
    db.create_tenant("acme", {"max_adapters": 3}, "admin")
    db.close()
    # Make the file what version 1 wrote: no residency column, the residency quotas in `quotas`.
    con = sqlite3.connect(tmp_path / "registry.sqlite")
    con.execute("ALTER TABLE tenants DROP COLUMN residency")
    con.execute(
        """UPDATE tenants SET quotas = '{"max_adapters": 3, "cold_load_bytes_per_minute": 1000, """
        """"device_residency_bytes": 5000}' WHERE name = 'acme'"""
    )
    con.execute("UPDATE schema_info SET version = 1")
    con.commit()
    con.close()
    upgraded = RegistryDB.in_dir(str(tmp_path))
    assert upgraded.schema_version == 2
    assert upgraded.tenants()["acme"] == {"max_adapters": 3}
    assert upgraded.residency() == {
        "acme": {"cold_load_bytes_per_minute": 1000, "device_budget_bytes": 5000},
        "default": {},
    }
    upgraded.set_residency("acme", {"priority": 3.0}, "admin")
    assert upgraded.residency()["acme"] == {"priority": 3.0}
    upgraded.close()


def test_guaranteed_adapter_count_holds_against_other_tenants() -> None:
    policy = EvictionPolicy(EvictionConfig(tenants={"steady": TenantLimits(guaranteed_adapters=2)}))
    resident = [Candidate(f"s{i}", "steady", MB, Tier.HOST) for i in range(3)]
    choice = policy.choose_victims(2 * MB, 0, resident, "flood", now=0.0)
    assert not choice.ok and "guaranteed residency" in (choice.refusal or "")
    assert len(policy.choose_victims(MB, 0, resident, "flood", now=0.0).victims) == 1
    assert len(policy.choose_victims(2 * MB, 0, resident, "steady", now=0.0).victims) == 2  # its own


def test_guarantees_summed_over_tenants_must_fit_the_device_budget() -> None:
    limits = {
        "gold": TenantLimits(guaranteed_bytes=6 * MB),
        "silver": TenantLimits(guaranteed_bytes=4 * MB),
        "free": TenantLimits(guaranteed_adapters=3),  # counts are not summed: sizes are unknown
    }
    assert guarantee_overcommit(limits, 10 * MB) is None  # exactly full is allowed
    why = guarantee_overcommit(limits, 10 * MB - 1)
    assert why is not None
    assert f"sum to {10 * MB} (gold {6 * MB}, silver {4 * MB})" in why
    assert f"budget of {10 * MB - 1} bytes" in why and "free" not in why
    assert guarantee_overcommit({}, 0) is None
