"""Asynchronous adapter loads (adapters/h2d_copy.py) on the CPU, with copies completed by hand.

The copier here writes NaN into the reserved room at once and the real bytes only when the test
completes its event, so anything that read a slot before its copy completed would see NaN (and
wrong outputs) instead of passing by luck.
"""

from __future__ import annotations

import sys

import pytest
import torch

from loraplex.adapters.device_pool import AdapterPool
from loraplex.adapters.h2d_copy import AsyncLoads, copy_weights, packed_spans
from loraplex.adapters.host_cache import HostCache
from loraplex.adapters.residency import AdapterResidency
from loraplex.bench.capacity_load import ImmediateCopier
from loraplex.lora.triton_table import LoRADeviceTable
from loraplex.lora.weights import AdapterWeights, LoRAPair, LoRASlotTable

DTYPE = torch.float32


class ManualEvent:
    def __init__(self, dst: AdapterWeights, src: AdapterWeights) -> None:
        self.dst, self.src, self.done = dst, src, False

    def complete(self) -> None:
        copy_weights(self.dst, self.src, non_blocking=False)
        self.done = True

    def query(self) -> bool:
        return self.done

    def synchronize(self) -> None:
        if not self.done:
            self.complete()


class ManualCopier:
    def __init__(self) -> None:
        self.events: list[ManualEvent] = []

    def copy(self, dst: AdapterWeights, src: AdapterWeights) -> ManualEvent:
        # poison the room until the copy "completes": a step reading it early would see NaN
        if dst.packed is not None:
            dst.packed.fill_(float("nan"))
        for p in dst.pairs.values():
            p.a.fill_(float("nan"))
            p.b.fill_(float("nan"))
        self.events.append(ManualEvent(dst, src))
        return self.events[-1]


def _weights(seed: int, rank: int = 4, layers: int = 2) -> AdapterWeights:
    g = torch.Generator().manual_seed(seed)
    pairs = {}
    for layer in range(layers):
        for target, (d_in, d_out) in {"q": (24, 24), "down": (40, 24)}.items():
            a, b = torch.randn(rank, d_in, generator=g), torch.randn(d_out, rank, generator=g)
            pairs[(layer, target)] = LoRAPair(a, b, 2.0)
    return AdapterWeights(pairs)


def _residency(budget: int) -> AdapterResidency:
    pool = AdapterPool(budget, DTYPE, "cpu")
    return AdapterResidency(LoRASlotTable(4, DTYPE), DTYPE, "cpu", pool)


def _equal(x: AdapterWeights, y: AdapterWeights) -> bool:
    return all(
        torch.equal(x.pairs[k].a, y.pairs[k].a) and torch.equal(x.pairs[k].b, y.pairs[k].b) for k in x.pairs
    )


def test_host_copies_are_packed_like_the_pool_so_a_load_is_one_copy() -> None:
    res = _residency(1 << 20)
    host = HostCache(1 << 20, DTYPE).host_copy(_weights(1))
    assert res.pool is not None
    room = res.reserve("r", host)  # the extent as one span; the views come from the pool
    dst = res.pool.weights("r")
    assert not room.pairs and room.packed is not None and dst.packed is not None
    assert room.packed.data_ptr() == dst.packed.data_ptr() and room.packed.numel() == dst.packed.numel()
    spans = packed_spans(dst, host)
    assert spans is not None and spans[0].numel() * 4 == res.pool.allocated_of("r")
    # both carry their extent's span: the copy is that one span, and it covers every tensor
    assert host.packed is not None
    assert room.packed.numel() * 4 == res.pool.allocated_of("r") == host.packed.numel() * 4
    room.packed.fill_(float("nan"))
    copy_weights(room, host, non_blocking=False)
    assert _equal(dst, host)
    # the span fast path gives the bytes the per-tensor check would have copied
    assert torch.equal(spans[0], spans[1])
    # weights not packed alike (separate tensors) still copy right, pair by pair
    loose = _weights(2)
    assert packed_spans(dst, loose) is None
    copy_weights(dst, loose, non_blocking=False)
    assert _equal(dst, loose)


def test_a_host_copy_keeps_no_views_of_its_pairs() -> None:
    """The per-pair views the copy wrote through are dropped (each is a tracked object every full
    GC pass would walk while the adapter stays cached); a read makes them again, right."""
    src = _weights(6)
    host = HostCache(1 << 20, DTYPE).host_copy(src)
    assert not host.pairs.built  # type: ignore[attr-defined]
    assert _equal(host, src) and host.pairs.built  # type: ignore[attr-defined]


def test_a_load_is_resident_only_once_its_copy_completed() -> None:
    res = _residency(1 << 20)
    copier = ManualCopier()
    loads = AsyncLoads(res, copier)
    host = HostCache(1 << 20, DTYPE).host_copy(_weights(3))
    loads.start("r", host)
    assert "r" in loads and not res.is_resident("r") and "r" in res.pool.in_flight  # type: ignore[union-attr]
    assert loads.finished() == [] and not res.is_resident("r")
    copier.events[0].complete()
    assert loads.finished() == ["r"] and res.is_resident("r") and "r" not in loads
    assert _equal(res.weights("r"), host)
    assert len(loads.latencies) == 1 and loads.latencies[0][0] == host.nbytes


def test_compaction_never_moves_a_load_in_flight() -> None:
    unit = AdapterPool(1 << 20, DTYPE, "cpu").footprint(_weights(0))  # a 2-layer adapter
    res = _residency(6 * unit)
    pool = res.pool
    assert pool is not None
    copier = ManualCopier()
    loads = AsyncLoads(res, copier)
    res.load("a0", _weights(10))  # [0]
    res.load("a1", _weights(11, layers=4))  # [1, 2]
    res.load("a2", _weights(12))  # [3]
    x = HostCache(1 << 20, DTYPE).host_copy(_weights(4))
    loads.start("x", x)  # [4], in flight
    res.evict("a0")
    res.evict("a2")  # holes at 0, 3 and 5: moving x (1 unit) would be cheaper than a1 (2)
    start_x = pool._extents["x"].start
    res.load("big", _weights(5, layers=4))
    assert pool._extents["x"].start == start_x and pool.compactions == 1
    pool.check_integrity()
    copier.events[0].complete()
    assert loads.finished() == ["x"] and _equal(res.weights("x"), x)
    assert _equal(res.weights("a1"), _weights(11, layers=4))


def test_cancel_gives_the_room_back() -> None:
    res = _residency(1 << 20)
    loads = AsyncLoads(res, ManualCopier())
    loads.start("r", HostCache(1 << 20, DTYPE).host_copy(_weights(7)))
    assert res.pool is not None and res.pool.allocated_bytes > 0
    loads.cancel("r")
    assert res.pool.allocated_bytes == 0 and "r" not in loads and not res.is_resident("r")


def _calls_of_one_load(layers: int) -> int:
    """Python and C function calls of one load of a `layers`-layer adapter from the host tier,
    from its start until the kernels' tables point at it (its layout seen once before)."""
    host = HostCache(1 << 30, DTYPE).host_copy(_weights(5, rank=8, layers=layers))
    table = LoRASlotTable(layers, DTYPE, capacity=4)
    res = AdapterResidency(table, DTYPE, "cpu", AdapterPool(1 << 22, DTYPE, "cpu"))
    tables = LoRADeviceTable(torch.device("cpu"))
    loads = AsyncLoads(res, ImmediateCopier())

    def load(revision: str) -> None:
        loads.start(revision, host)
        tables.sync(table)  # the next step's (on CUDA while the copy runs)
        assert loads.finished() == [revision]
        tables.sync(table)

    load("warm")  # the layout's per-pair arrays and column image, once per layout
    res.evict("warm")
    calls = 0

    def count(frame: object, event: str, arg: object) -> None:
        nonlocal calls
        calls += event in ("call", "c_call")

    sys.setprofile(count)
    try:
        load("r")
    finally:
        sys.setprofile(None)
    assert not res.weights("r").pairs.built  # type: ignore[attr-defined]  # no tensor views made
    assert _equal(res.weights("r"), host)
    return calls


def test_a_loads_host_work_does_not_grow_with_its_pairs() -> None:
    """A 16-layer adapter's load makes exactly as many calls as a 2-layer one's: nothing on the
    path from the load's start to usable kernel tables walks the (layer, target) pairs."""
    assert _calls_of_one_load(16) == _calls_of_one_load(2)


def test_adapters_of_the_same_shapes_share_one_layout() -> None:
    """Host copies of two adapters with the same pairs, shapes and scales carry one layout object
    (its pairs and arrays made once); another rank or scale gets its own; bad shapes still raise."""
    from loraplex.lora.packed import pack_layout

    host = HostCache(1 << 22, DTYPE)
    one, two = host.host_copy(_weights(11)), host.host_copy(_weights(12))
    assert one.layout is not None and one.layout is two.layout
    assert _equal(one, _weights(11)) and _equal(two, _weights(12))  # the weights stay their own
    other_rank = host.host_copy(_weights(13, rank=8))
    assert other_rank.layout is not one.layout and other_rank.layout is not None
    rescaled = _weights(14)
    rescaled.pairs[(0, "q")] = LoRAPair(rescaled.pairs[(0, "q")].a, rescaled.pairs[(0, "q")].b, 3.0)
    assert pack_layout(rescaled, 4) is not one.layout
    bad = _weights(15)
    bad.pairs[(1, "down")] = LoRAPair(torch.zeros(4, 40), torch.zeros(24, 5), 2.0)
    with pytest.raises(ValueError, match="does not match A's rank"):
        pack_layout(bad, 4)
