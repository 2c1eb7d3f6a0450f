"""The identity/residency seam on its own (no model): the registry knows names, revisions and holds
and imports no torch; residency maps revisions to slots, pins the slots of one step, frees and
reuses slots with a generation that exposes stale per-step data."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from loraplex.adapters.registry import AdapterRegistry, UnknownAdapterError
from loraplex.adapters.residency import (
    AdapterResidency,
    Residency,
    SlotInUseError,
    StaleSlotError,
    StepSlots,
)
from loraplex.lora.metadata import BASE_SLOT
from loraplex.lora.weights import AdapterWeights, LoRAPair, LoRASlotTable
from loraplex.types import AdapterRef

REV_A, REV_B, REV_C = "a" * 64, "b" * 64, "c" * 64
A, B, C = (AdapterRef(n, r) for n, r in (("a", REV_A), ("b", REV_B), ("c", REV_C)))


def _weights(rank: int, layers: int = 2, seed: int = 0) -> AdapterWeights:
    g = torch.Generator().manual_seed(seed)
    pairs = {
        (layer, target): LoRAPair(torch.randn(rank, 8, generator=g), torch.randn(12, rank, generator=g), 0.5)
        for layer in range(layers)
        for target in ("q", "down")
    }
    return AdapterWeights(pairs)


def test_registry_imports_no_torch() -> None:
    code = "import sys, loraplex.adapters.registry as r; r.AdapterRegistry(); print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_registry_names_revisions_and_holds() -> None:
    reg = AdapterRegistry()
    a = reg.add("sql", REV_A, 16, 1000, {"r": 16})
    b = reg.add("sql", REV_B, 8, 500, {"r": 8})
    assert reg.latest("sql") == b and reg.resolve(f"sql@{REV_A[:8]}").ref == a
    assert reg.add("sql", REV_A, 16, 1000, {}) == a and reg.latest("sql") == a  # re-adding repoints latest
    assert reg.acquire(None) is None
    held = reg.acquire("sql")
    assert held == a and reg.holds(a) == 1 and reg.held_revisions() == {REV_A}
    reg.release(held)
    assert reg.holds(a) == 0 and reg.held_revisions() == set()
    for bad in ("nope", "sql@", "sql@ffffff", "../x", "sql@" + "z" * 8):
        with pytest.raises(UnknownAdapterError):
            reg.acquire(bad)
    assert reg.held_revisions() == set()
    with pytest.raises(ValueError, match="invalid adapter name"):
        reg.add("a/b", REV_C, 8, 1, {})


def test_residency_loads_once_per_revision_and_computes_facts_at_load() -> None:
    table = LoRASlotTable(2)
    res = AdapterResidency(table, torch.float32, "cpu")
    w = _weights(4)
    facts = res.load(REV_A, w)
    assert res.load(REV_A, _weights(4, seed=9)) == facts  # already resident: nothing is reloaded
    assert facts.slot == 0 and facts.generation == 0 and facts.max_rank == 4
    assert facts.ranks == {(layer, t): 4 for layer in range(2) for t in ("q", "down")}
    assert facts.nbytes == w.nbytes and facts.groups == w.groups
    assert len(table) == 1 and res.state(REV_A) is Residency.RESIDENT
    assert res.state(REV_B) is Residency.PENDING
    with pytest.raises(LookupError, match="not resident"):
        res.ensure(REV_B)


def test_step_pins_and_freed_slots_are_reused_with_a_new_generation() -> None:
    table = LoRASlotTable(2)
    res = AdapterResidency(table, torch.float32, "cpu")
    res.load(REV_A, _weights(4))
    res.load(REV_B, _weights(8, seed=1))
    step = res.step_slots([B, None, A, B])
    assert step.slots == [1, BASE_SLOT, 0, 1] and step.generations == {0: 0, 1: 0}
    assert res.pinned == {0, 1}
    with pytest.raises(SlotInUseError):
        res.evict(REV_A)  # pinned by the running step
    res.check(step)
    res.end_step()
    assert res.pinned == frozenset()

    version = table.version
    res.evict(REV_A)
    assert 0 not in table and table.version > version and res.state(REV_A) is Residency.PENDING
    with pytest.raises(StaleSlotError):
        res.check(step)  # the map names slot 0, which no longer holds REV_A
    facts = res.load(REV_C, _weights(2, seed=2))
    assert facts.slot == 0 and facts.generation == 2  # the freed slot; freeing and loading each bump it
    with pytest.raises(StaleSlotError):
        res.check(step)
    fresh = res.step_slots([C, B])
    res.check(fresh)
    res.end_step()
    assert table.weights(0).max_rank == 2 and res.num_resident == 2
    assert res.resident_bytes == table.weights(0).nbytes + table.weights(1).nbytes
    res.evict(REV_C)
    res.evict(REV_B)
    assert res.load(REV_A, _weights(4)).slot == 0  # lowest free slot first
    assert isinstance(fresh, StepSlots)


def test_a_failed_load_changes_nothing() -> None:
    table = LoRASlotTable(2)
    res = AdapterResidency(table, torch.float32, "cpu")

    class Broken(AdapterWeights):
        def to(self, device, dtype):  # noqa: ANN001, ANN202
            raise RuntimeError("out of memory")

    with pytest.raises(RuntimeError):
        res.load(REV_A, Broken({}))
    assert len(table) == 0 and res.num_resident == 0 and res.load(REV_B, _weights(4)).slot == 0


def test_version_tracks_slot_changes_and_repin_pins_a_kept_map() -> None:
    table = LoRASlotTable(2)
    res = AdapterResidency(table, torch.float32, "cpu")
    v0 = res.version
    res.load(REV_A, _weights(4))
    assert res.version == v0 + 1
    res.load(REV_A, _weights(4))  # already resident: nothing changed
    assert res.version == v0 + 1
    step = res.step_slots([A, None, A])
    res.end_step()
    assert res.pinned == frozenset()
    res.repin(step)  # the same map, one more step
    assert res.pinned == {0}
    res.end_step()
    res.evict(REV_A)
    assert res.version == v0 + 2
