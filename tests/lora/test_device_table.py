"""The Triton backend's device tables (lora/triton_table.py) on the CPU, no triton needed: updated
slot by slot as adapters load into the device pool, move in a compaction and leave, they always
hold what the adapters' own tensors say; an adapter reloaded from the host tier costs no upload."""

from __future__ import annotations

import random

import pytest
import torch

from loraplex.adapters.device_pool import AdapterPool
from loraplex.adapters.host_cache import HostCache
from loraplex.adapters.residency import AdapterResidency
from loraplex.lora.layout import TARGETS, pair_row
from loraplex.lora.triton_table import LoRADeviceTable
from loraplex.lora.weights import AdapterWeights, LoRAPair, LoRASlotTable

DTYPE = torch.float32
LAYERS = 3
SHAPES = {"q": (32, 32), "k": (32, 8), "up": (32, 48), "down": (48, 32)}  # (d_in, d_out)
CPU = torch.device("cpu")


def _adapter(seed: int, rank: int) -> AdapterWeights:
    rng = random.Random(seed)
    g = torch.Generator().manual_seed(seed)
    targets = rng.sample(sorted(SHAPES), rng.randint(1, len(SHAPES)))
    pairs = {}
    for layer in range(LAYERS):
        for t in targets:
            d_in, d_out = SHAPES[t]
            a, b = torch.randn(rank, d_in, generator=g), torch.randn(d_out, rank, generator=g)
            pairs[(layer, t)] = LoRAPair(a, b, 0.25 + seed)
    return AdapterWeights(pairs)


def _check(dev: LoRADeviceTable, table: LoRASlotTable) -> None:
    """Every column against the slot's own pairs (read through their views); odd ranks (padded
    copies, addresses of their own) against a table rebuilt from scratch."""
    fresh = LoRADeviceTable(CPU)
    fresh.sync(table)
    a, b, r, s = dev._a, dev._b, dev._r, dev._s
    elem, base = dev.base.element_size(), dev.base.data_ptr()
    want_r, want_s = torch.zeros_like(r), torch.zeros_like(s)
    for slot, weights in table.items():
        for (layer, t), pair in weights.pairs.items():
            row = pair_row(layer, t)
            want_r[row, slot], want_s[row, slot] = -(-pair.rank // 8) * 8, pair.scale
            if pair.rank % 8 == 0:  # read in place: the offsets are the views' own
                assert a[row, slot] == (pair.a.data_ptr() - base) // elem, (slot, layer, t)
                assert b[row, slot] == (pair.b.data_ptr() - base) // elem, (slot, layer, t)
        assert dev.slot_coverage[slot] == sum(1 << pair_row(*k) for k in weights.pairs)
        assert dev.slot_max_rank[slot] == max(-(-p.rank // 8) * 8 for p in weights.pairs.values())
    assert torch.equal(r, want_r) and torch.equal(s, want_s)
    unset = want_r == 0  # absent pairs, empty slots and the null slot: offset 0
    assert not a[unset].any() and not b[unset].any()
    # the same addresses as a rebuild's (each table has a base of its own), odd ranks aside
    odd = {slot for slot, w in table.items() if any(p.rank % 8 for p in w.pairs.values())}
    even = ~unset
    even[:, sorted(odd)] = False
    fresh_base = fresh.base.data_ptr()
    for mine, theirs in ((a, fresh._a), (b, fresh._b)):
        assert torch.equal(mine[even] * elem + base, theirs[even] * elem + fresh_base)
    assert torch.equal(r, fresh._r) and torch.equal(s, fresh._s)
    assert dev.slot_coverage == fresh.slot_coverage and dev.slot_max_rank == fresh.slot_max_rank
    assert (
        dev.dims == fresh.dims == {(layer, t): SHAPES[t] for _, w in table.items() for (layer, t) in w.pairs}
    )
    assert set(dev.dims) <= {(layer, t) for layer in range(LAYERS) for t in TARGETS}


def test_slot_by_slot_updates_match_the_adapters_through_loads_moves_and_evictions() -> None:
    rng = random.Random(0)
    adapters = {f"x{i}": _adapter(i, rng.choice((8, 16, 8, 5))) for i in range(10)}
    host = HostCache(1 << 30, DTYPE)
    copies = {k: host.host_copy(w) for k, w in adapters.items()}
    unit = AdapterPool(1 << 20, DTYPE, "cpu").footprint(copies["x0"])
    table = LoRASlotTable(LAYERS, DTYPE, capacity=4)
    res = AdapterResidency(table, DTYPE, "cpu", AdapterPool(5 * unit, DTYPE, "cpu"))
    assert res.pool is not None
    dev = LoRADeviceTable(CPU)
    dev.sync(table)
    epoch = dev.epoch
    for step in range(120):
        resident = res.resident_revisions()
        if resident and (rng.random() < 0.4 or len(resident) >= 4):
            res.evict(rng.choice(resident))
        else:
            key = rng.choice([k for k in copies if k not in resident])
            if res.pool.fits(res.pool.footprint(copies[key])):
                res.load(key, copies[key])
        if step % 3:  # several changes between syncs, too
            continue
        version = dev.version
        dev.sync(table)
        assert dev.version == table.version >= version
        _check(dev, table)
    assert res.pool.compactions > 0  # moved adapters were re-pointed in place
    assert dev.epoch == epoch  # never reallocated: captured graphs stay valid
    for key, weights in copies.items():  # and what the tables point at is the adapters' bytes
        if res.is_resident(key):
            placed = res.weights(key)
            assert all(torch.equal(placed.pairs[k].a, p.a) for k, p in weights.pairs.items())


def test_a_reload_from_the_host_tier_uploads_nothing() -> None:
    copy = HostCache(1 << 30, DTYPE).host_copy(_adapter(3, 16))
    table = LoRASlotTable(LAYERS, DTYPE, capacity=2)
    res = AdapterResidency(table, DTYPE, "cpu", AdapterPool(1 << 20, DTYPE, "cpu"))
    dev = LoRADeviceTable(CPU)
    dev.sync(table)
    res.load("r", copy)
    dev.sync(table)
    uploads = dev.uploads  # the layout's column image, once
    for i in range(5):
        res.evict("r" if i == 0 else f"r{i - 1}")
        res.load(f"r{i}", copy)
        dev.sync(table)
        assert not res.weights(f"r{i}").pairs.built  # type: ignore[attr-defined]  # nor tensor views
        _check(dev, table)
    assert dev.uploads == uploads == 1


def test_a_failed_update_leaves_the_tables_as_they_were() -> None:
    def q_only(d_in: int) -> AdapterWeights:
        return AdapterWeights({(0, "q"): LoRAPair(torch.randn(8, d_in), torch.randn(32, 8), 1.0)})

    table = LoRASlotTable(LAYERS, DTYPE, capacity=2)
    table.set(0, q_only(32))
    dev = LoRADeviceTable(CPU)
    dev.sync(table)
    before = dev._buf.clone()
    table.set(1, q_only(33))  # another adapter's q is 32 wide
    with pytest.raises(ValueError, match="shape differs"):
        dev.sync(table)
    assert torch.equal(dev._buf, before)
    table.clear(1)
    dev.sync(table)
    assert torch.equal(dev._buf, before)
