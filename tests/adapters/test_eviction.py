"""The eviction policy on ids alone: protected adapters, cost/recency/frequency order, tenant
budgets and guarantees, the cold-load rate limit, deterministic ties."""

from __future__ import annotations

import random
import subprocess
import sys
from dataclasses import replace
from typing import Any

import pytest

from loraplex.adapters.eviction import (
    Candidate,
    EvictionConfig,
    EvictionPolicy,
    TenantLimits,
    Tier,
)

MB = 1 << 20


def _c(id: str, tenant: str = "t", nbytes: int = MB, tier: Tier = Tier.HOST, **kw: int) -> Candidate:
    return Candidate(id, tenant, nbytes, tier, **kw)


def test_imports_no_torch() -> None:
    code = "import sys, loraplex.adapters.eviction as e; e.EvictionPolicy(); print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_nothing_evicted_when_the_pool_has_room() -> None:
    choice = EvictionPolicy().choose_victims(MB, 2 * MB, [_c("a")], "t", now=0.0)
    assert choice.ok and choice.victims == () and choice.freed_bytes == 0


def test_never_referenced_or_queued_for() -> None:
    policy = EvictionPolicy()
    for i in range(3):
        policy.touch("idle", float(i))  # the idle one is the hottest: only protection can spare the others
    cands = [_c("running", references=1), _c("waited", queued=2), _c("idle")]
    choice = policy.choose_victims(MB, 0, cands, "t", now=3.0)
    assert choice.victims == ("idle",)
    refused = policy.choose_victims(2 * MB, 0, cands, "t", now=3.0)
    assert refused.victims == () and not refused.ok
    assert refused.refusal == (
        f"tenant 't' needs {2 * MB} device bytes freed and at most {MB} can be: {MB} bytes serve running "
        f"requests, {MB} bytes await queued requests, 0 bytes are other tenants' guaranteed residency"
    )


def test_prefers_cheap_to_reload_cold_and_rare() -> None:
    policy = EvictionPolicy()
    # cost: same use, one comes back from host memory, the other from disk
    policy.touch("host", 0.0)
    policy.touch("disk", 0.0)
    cands = [_c("disk", tier=Tier.DISK), _c("host", tier=Tier.HOST)]
    assert policy.choose_victims(MB, 0, cands, "t", now=1.0).victims == ("host",)
    # recency: used as often, one long ago
    policy.touch("old", 0.0)
    policy.touch("new", 300.0)
    assert policy.choose_victims(MB, 0, [_c("new"), _c("old")], "t", now=301.0).victims == ("old",)
    # frequency: last used at the same time, one ten times as often
    for _ in range(10):
        policy.touch("hot", 400.0)
    policy.touch("rare", 400.0)
    assert policy.choose_victims(MB, 0, [_c("hot"), _c("rare")], "t", now=401.0).victims == ("rare",)
    # heat decays: a burst an hour ago is worth less than one use a second ago
    assert policy.heat("hot", 4000.0) < policy.heat("new", 301.0)


def test_reload_bytes_and_priority_weigh_in() -> None:
    config = EvictionConfig(tenants={"gold": TenantLimits(priority=10.0)})
    policy = EvictionPolicy(config)
    cands = [_c("gold-a", tenant="gold"), _c("free-a", tenant="free")]
    assert policy.choose_victims(MB, 0, cands, "free", now=0.0).victims == ("free-a",)
    # an adapter whose reload reads four times its device bytes (float32 on disk, bf16 on device)
    cands = [_c("fat", reload_bytes=4 * MB), _c("lean")]
    assert policy.choose_victims(MB, 0, cands, "t", now=0.0).victims == ("lean",)


def test_picks_enough_bytes_and_puts_back_the_unneeded() -> None:
    policy = EvictionPolicy()
    policy.touch("big", 0.0)  # warmer than the small ones, but alone it frees enough
    cands = [_c("s1", nbytes=MB // 4), _c("s2", nbytes=MB // 4), _c("big", nbytes=4 * MB)]
    choice = policy.choose_victims(3 * MB, 0, cands, "t", now=1.0)
    assert choice.victims == ("big",) and choice.freed_bytes == 4 * MB
    choice = policy.choose_victims(MB // 2, 0, cands, "t", now=1.0)
    assert choice.victims == ("s1", "s2")


def test_ties_are_broken_deterministically() -> None:
    policy = EvictionPolicy()
    cands = [_c(f"a{i:02d}") for i in range(20)]
    policy.touch("a07", 5.0)
    policy.touch("a03", 5.0)
    policy.touch("a03", 5.0)  # hotter
    rng = random.Random(0)
    seen = set()
    for _ in range(10):
        rng.shuffle(cands)
        seen.add(policy.choose_victims(20 * MB, 0, cands, "t", now=5.0).victims)
    assert len(seen) == 1
    (order,) = seen
    assert order[-2:] == ("a07", "a03") and list(order[:18]) == sorted(order[:18])
    # equal value, unequal recency: the least recently used goes first (ids alone would say x)
    policy.touch("y", -60.0)
    policy.touch("y", -60.0)  # two uses a half-life ago ...
    policy.touch("x", 0.0)  # ... are worth one use now
    assert policy.heat("x", 0.0) == policy.heat("y", 0.0) == 1.0
    assert policy.choose_victims(MB, 0, [_c("x"), _c("y")], "t", now=0.0).victims == ("y",)


def test_a_flooding_tenant_cannot_evict_another_tenants_guaranteed_share() -> None:
    config = EvictionConfig(tenants={"steady": TenantLimits(guaranteed_bytes=2 * MB)})
    policy = EvictionPolicy(config)
    resident = [_c("steady-1", "steady"), _c("steady-2", "steady"), _c("steady-3", "steady")]
    for c in resident:
        policy.touch(c.id, 0.0)
    free, pool = 0, 6 * MB
    flooded = 0
    for i in range(50):  # the flood: cold adapters, each used once, each newer than the last
        now = 10.0 + i
        new = _c(f"flood-{i}", "flood")
        choice = policy.choose_victims(new.nbytes, free, resident, "flood", now)
        if not choice.ok:
            assert "guaranteed residency" in (choice.refusal or "")
            continue
        resident = [c for c in resident if c.id not in choice.victims] + [new]
        policy.touch(new.id, now)
        free = pool - sum(c.nbytes for c in resident)
        flooded += 1
    steady = sum(c.nbytes for c in resident if c.tenant == "steady")
    assert steady == 2 * MB and flooded == 50  # the unguaranteed third went; the share stayed
    # the steady tenant may replace its own guaranteed adapters
    choice = policy.choose_victims(MB, 0, [c for c in resident if c.tenant == "steady"], "steady", 100.0)
    assert choice.ok and len(choice.victims) == 1


def test_tenant_device_budget() -> None:
    config = EvictionConfig(tenants={"small": TenantLimits(device_budget_bytes=2 * MB)})
    policy = EvictionPolicy(config)
    policy.touch("other", 0.0)
    resident = [_c("mine-1", "small"), _c("mine-2", "small"), _c("other", "big")]
    # the pool has room, but the tenant's budget does not: it evicts its own, not the colder other
    choice = policy.choose_victims(MB, 10 * MB, resident, "small", now=1.0)
    assert choice.victims == ("mine-1",)
    busy = [_c("mine-1", "small", references=1), _c("mine-2", "small", queued=1), _c("other", "big")]
    refused = policy.choose_victims(MB, 10 * MB, busy, "small", now=1.0)
    assert refused.refusal == (
        f"tenant 'small' holds {2 * MB} device bytes of its budget {2 * MB}; loading {MB} more needs {MB} "
        "of its own freed, and only 0 are evictable (the rest serve or await requests)"
    )
    too_big = policy.choose_victims(3 * MB, 10 * MB, [], "small", now=1.0)
    assert (
        too_big.refusal
        == f"tenant 'small': the adapter needs {3 * MB} bytes, over its device budget of {2 * MB} bytes"
    )


def test_cold_load_rate_limit_is_a_token_bucket() -> None:
    config = EvictionConfig(tenants={"t": TenantLimits(cold_load_bytes_per_minute=60 * MB)})
    policy = EvictionPolicy(config)
    assert policy.admit_cold_load("t", 40 * MB, now=0.0)  # the bucket starts full: 60 MB
    assert policy.admit_cold_load("t", 20 * MB, now=0.0)
    assert not policy.admit_cold_load("t", MB, now=0.0)
    assert policy.cold_load_wait("t", 10 * MB, now=0.0) == pytest.approx(10.0)  # 1 MB/s
    assert not policy.admit_cold_load("t", 10 * MB, now=9.0)
    assert policy.admit_cold_load("t", 10 * MB, now=10.0)
    assert not policy.admit_cold_load("t", MB, now=5.0)  # a clock stepping back refills nothing
    assert policy.admit_cold_load("other", 10_000 * MB, now=0.0)  # no limit configured
    assert policy.cold_load_wait("other", 10_000 * MB, now=0.0) == 0.0
    # a load larger than the bucket waits for a full bucket, then goes (leaving it in debt)
    assert policy.cold_load_wait("t", 100 * MB, now=10.0) == pytest.approx(60.0)
    assert policy.admit_cold_load("t", 100 * MB, now=70.0)
    assert policy.cold_load_wait("t", MB, now=70.0) == pytest.approx(41.0)


@pytest.mark.parametrize(
    "kwargs,message",
    [
        ({"priority": 0.0}, "tenant priority must be > 0, got 0.0"),
        ({"guaranteed_bytes": -1}, "guaranteed_bytes must be >= 0, got -1"),
        ({"cold_load_burst_bytes": 0}, "cold_load_burst_bytes must be > 0, got 0"),
        (
            {"guaranteed_bytes": 3, "device_budget_bytes": 2},
            "guaranteed_bytes 3 exceed the device budget of 2 bytes",
        ),
    ],
)
def test_limits_are_validated(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        TenantLimits(**kwargs)
    with pytest.raises(ValueError, match="frequency_half_life must be > 0 seconds, got 0"):
        EvictionConfig(frequency_half_life=0)
    with pytest.raises(ValueError, match="needs a cost >= 0 for the disk tier, got None"):
        EvictionConfig(reload_cost_per_byte={Tier.HOST: 1.0})


def test_random_choices_keep_every_rule() -> None:
    """Seeded random pools: a choice frees enough, spares protected adapters and other tenants'
    guarantees, keeps the requester within its budget, and holds no victim it could put back."""
    rng = random.Random(18)
    tenants = ["a", "b", "c"]
    for trial in range(300):
        limits = {
            t: TenantLimits(
                priority=rng.choice([0.5, 1.0, 4.0]),
                guaranteed_bytes=rng.choice([0, 2 * MB, 4 * MB]),
                device_budget_bytes=rng.choice([None, 6 * MB, 12 * MB]),
            )
            for t in tenants
        }
        policy = EvictionPolicy(EvictionConfig(tenants=limits))
        resident = [
            _c(
                f"{t}{i}",
                t,
                rng.randint(1, 4) * MB // 2,
                rng.choice(list(Tier)),
                references=int(rng.random() < 0.15),
            )
            for t in tenants
            for i in range(rng.randint(0, 6))
        ]
        resident = [c if rng.random() > 0.15 else replace(c, queued=1) for c in resident]
        for c in resident:
            for _ in range(rng.randint(0, 3)):
                policy.touch(c.id, rng.uniform(0, 100))
        requester, incoming = rng.choice(tenants), rng.randint(1, 6) * MB // 2
        free = rng.randint(0, 4) * MB // 2
        choice = policy.choose_victims(incoming, free, resident, requester, now=100.0)
        if not choice.ok:
            assert choice.victims == () and choice.refusal
            continue
        by_id = {c.id: c for c in resident}
        victims = [by_id[v] for v in choice.victims]
        assert all(v.references == 0 and v.queued == 0 for v in victims), trial
        assert choice.freed_bytes == sum(v.nbytes for v in victims) >= incoming - free
        kept = [c for c in resident if c.id not in choice.victims]
        for t in tenants:
            before = sum(c.nbytes for c in resident if c.tenant == t)
            after = sum(c.nbytes for c in kept if c.tenant == t)
            if t != requester and after < before:
                assert after >= limits[t].guaranteed_bytes, trial
        budget = limits[requester].device_budget_bytes
        if budget is not None:
            assert sum(c.nbytes for c in kept if c.tenant == requester) + incoming <= budget, trial
        for v in victims:  # minimal: none could be put back
            rest = [w for w in victims if w is not v]
            own = sum(c.nbytes for c in kept if c.tenant == requester) + (
                v.nbytes if v.tenant == requester else 0
            )
            fits_pool = sum(w.nbytes for w in rest) >= incoming - free
            fits_budget = budget is None or own + incoming <= budget
            assert not (fits_pool and fits_budget), trial
