"""Free device bytes split by adapters that may not move (here pinned by a step; in serving
mostly adapters whose own loads are still copying, which the pool does not move either): a load
that fits the free bytes but no run of them waits, or evicts to make a run, and never raises out of
`poll` (which runs on the step thread: an exception there ends every request of the engine)."""

from __future__ import annotations

import torch

from loraplex.adapters.device_pool import AdapterPool
from loraplex.adapters.host_cache import HostCache
from loraplex.adapters.residency import AdapterResidency
from loraplex.adapters.tiers import AdapterTiers
from loraplex.lora.weights import AdapterWeights, LoRASlotTable
from loraplex.types import AdapterRef
from tests.adapters.test_device_pool import _adapter

SMALL, BIG = 8, 16  # the big adapter is exactly two small ones' bytes


def _setup(units: int) -> tuple[AdapterTiers, AdapterResidency, AdapterPool, list[AdapterRef | None], int]:
    probe = AdapterPool(1 << 24, torch.float32, "meta")
    unit = probe.footprint(_adapter(0, rank=SMALL))
    assert probe.footprint(_adapter(9, rank=BIG)) == 2 * unit
    table = LoRASlotTable(2, torch.float32, 8)
    pool = AdapterPool(units * unit, torch.float32, "cpu")
    residency = AdapterResidency(table, torch.float32, "cpu", pool)
    running: list[AdapterRef | None] = []
    tiers = AdapterTiers(residency, pool, HostCache(1 << 30, torch.float32), lambda: (running, []))
    return tiers, residency, pool, running, unit


def _same(got: AdapterWeights, want: AdapterWeights) -> bool:
    return all(
        torch.equal(got.pairs[k].a, p.a) and torch.equal(got.pairs[k].b, p.b) for k, p in want.pairs.items()
    )


def _split_by_pins(
    tiers: AdapterTiers, residency: AdapterResidency, running: list[AdapterRef | None]
) -> None:
    """Adapters a, b, c, d side by side; b and d run (pinned by the step), a and c evicted: two
    holes of one unit each between pinned adapters."""
    for i, name in enumerate("abcd"):
        tiers.register(name, _adapter(i, rank=SMALL), "")
    running[:] = [AdapterRef("b", "b"), AdapterRef("d", "d")]
    residency.step_slots(running)
    residency.evict("a")
    residency.evict("c")


def test_a_load_split_by_pinned_adapters_waits_then_loads_once_they_unpin() -> None:
    tiers, residency, pool, running, unit = _setup(4)
    _split_by_pins(tiers, residency, running)
    big = _adapter(9, rank=BIG)
    assert pool.free_bytes == 2 * unit > pool.largest_free_extent
    tiers.register("e", big, "")  # fits the free bytes, not a run of them: stays in the host tier
    assert not residency.is_resident("e")
    assert tiers.admit("e") == "host"
    tiers.poll()  # nothing may move or go (b and d run): it waits, no exception
    assert not tiers.ready("e") and residency.is_resident("b") and residency.is_resident("d")
    residency.end_step()  # the step ended and the next runs other adapters: b and d may move
    running.clear()
    tiers.poll()
    assert tiers.ready("e")
    assert _same(residency.weights("e"), big)
    for name, seed in (("b", 1), ("d", 3)):  # compaction moved them, bit for bit
        assert _same(residency.weights(name), _adapter(seed, rank=SMALL))
    pool.check_integrity()


def test_a_load_split_by_pinned_adapters_evicts_idle_ones_until_a_run_is_free() -> None:
    """a b c f d side by side, b and d pinned, c evicted: e (two units) needs room, and whichever
    idle adapter goes first, a run of two units next to the pinned ones must come free."""
    tiers, residency, pool, running, unit = _setup(5)
    for name, seed in (("a", 0), ("b", 1), ("c", 2), ("f", 5), ("d", 3)):
        tiers.register(name, _adapter(seed, rank=SMALL), "")
    running[:] = [AdapterRef("b", "b"), AdapterRef("d", "d")]
    residency.step_slots(running)
    residency.evict("c")
    big = _adapter(9, rank=BIG)
    tiers.register("e", big, "")  # no free room: host tier only
    assert tiers.admit("e") == "host"
    tiers.poll()
    assert tiers.ready("e") and _same(residency.weights("e"), big)
    for name, seed in (("b", 1), ("d", 3), ("a", 0), ("f", 5)):
        if name in "bd" or residency.is_resident(name):
            assert _same(residency.weights(name), _adapter(seed, rank=SMALL))
    assert tiers.stats()["evictions"] >= 1
    pool.check_integrity()
