"""The device adapter pool on the CPU: rank-exact extents, 16-byte aligned views, compaction that
keeps every adapter loadable whenever the free bytes suffice, and moved adapters read back bit for
bit."""

from __future__ import annotations

import random

import pytest
import torch

from loraplex.adapters.device_pool import ALIGN, AdapterPool, PoolFullError
from loraplex.lora.triton_entries import kernel_ready
from loraplex.lora.weights import AdapterWeights, LoRAPair

# (d_in, d_out) per target: mixed widths, one (36) whose rows are not a multiple of 16 bytes in fp16
SHAPES = {"q": (64, 64), "k": (64, 16), "o": (36, 64), "down": (96, 40)}


def _adapter(seed: int, rank: int | None = None, layers: int = 2) -> AdapterWeights:
    """Random weights: rank 4..64 per adapter, a few pairs of another rank (rank_pattern)."""
    rng = random.Random(seed)
    g = torch.Generator().manual_seed(seed)
    base = rank if rank is not None else rng.randint(4, 64)
    targets = rng.sample(sorted(SHAPES), rng.randint(1, len(SHAPES))) if rank is None else sorted(SHAPES)
    pairs = {}
    for layer in range(layers):
        for t in targets:
            r = base if rank is not None or rng.random() < 0.8 else rng.randint(4, 64)
            d_in, d_out = SHAPES[t]
            a, b = torch.randn(r, d_in, generator=g), torch.randn(d_out, r, generator=g)
            pairs[(layer, t)] = LoRAPair(a, b, 0.5)
    return AdapterWeights(pairs)


def _check_views(pool: AdapterPool, placed: AdapterWeights, ref: AdapterWeights) -> None:
    assert placed.pairs.keys() == ref.pairs.keys()
    for key, pair in placed.pairs.items():
        for view, src in ((pair.a, ref.pairs[key].a), (pair.b, ref.pairs[key].b)):
            assert view.is_contiguous() and view.data_ptr() % ALIGN == 0
            assert kernel_ready(view) is view  # the kernels' tables address the pool itself, no copy
            assert view.untyped_storage().data_ptr() == pool.buffer.untyped_storage().data_ptr()
            assert torch.equal(view, src.to(pool.dtype))
        assert pair.scale == ref.pairs[key].scale


def test_place_copies_exact_ranks_into_aligned_views() -> None:
    pool = AdapterPool(1 << 20, torch.float16, "cpu")
    w = _adapter(1, rank=5)  # odd rank: the o projection's A rows (36 x fp16) need alignment padding
    placed = pool.place("a", w).weights
    _check_views(pool, placed, w)
    assert pool.used_bytes == placed.nbytes == sum(p.a.numel() + p.b.numel() for p in w.pairs.values()) * 2
    assert pool.allocated_bytes == pool.footprint(w) == pool.allocated_of("a") > pool.used_bytes
    assert pool.allocated_bytes / pool.used_bytes <= 1.05
    assert pool.free_bytes == pool.budget_bytes - pool.allocated_bytes
    stats = pool.stats()
    assert stats["adapters"] == 1 and stats["allocated_bytes"] == pool.allocated_bytes
    assert stats["largest_free_extent"] == stats["free_bytes"] and stats["compactions"] == 0
    assert pool.weights("a").pairs[(0, "q")].a.data_ptr() == placed.pairs[(0, "q")].a.data_ptr()
    with pytest.raises(ValueError, match="already in the pool"):
        pool.place("a", w)
    pool.free("a")
    pool.free("a")  # absent: a no-op
    assert (pool.allocated_bytes, pool.used_bytes, len(pool)) == (0, 0, 0)
    pool.check_integrity()


@pytest.mark.parametrize("seed", [2, 3, 4])
def test_views_carry_the_facts_a_walk_of_their_pairs_finds(seed: int) -> None:
    """The pool's views get their facts from the layout (once per layout, not per load): they are
    what walking the views' own pairs gives, at the pool's dtype, reload after reload."""
    pool = AdapterPool(1 << 22, torch.bfloat16, "cpu")
    w = _adapter(seed)  # mixed ranks per pair (rank_pattern), some targets absent
    for key in ("a", "b"):  # the second load reuses the layout's facts
        placed = pool.place(key, w).weights
        walked = AdapterWeights(dict(placed.pairs))
        assert placed.ranks == walked.ranks == {k: p.a.shape[0] for k, p in w.pairs.items()}
        assert (placed.max_rank, placed.nbytes, placed.groups) == (
            walked.max_rank,
            walked.nbytes,
            walked.groups,
        )
        assert placed.nbytes == pool.actual_of(key)


def test_pool_arguments_are_checked() -> None:
    with pytest.raises(ValueError, match="adapter pool budget 8 bytes is below one 16-byte unit"):
        AdapterPool(8, torch.float16, "cpu")
    with pytest.raises(ValueError, match="adapter pool dtype must be a floating type, got torch.int8"):
        AdapterPool(1024, torch.int8, "cpu")
    assert AdapterPool(1000, torch.bfloat16, "cpu").budget_bytes == 992  # whole 16-byte units


def test_malformed_weights_change_nothing() -> None:
    pool = AdapterPool(1 << 16, torch.float32, "cpu")
    bad = AdapterWeights({(0, "q"): LoRAPair(torch.zeros(4, 8), torch.zeros(8, 3), 1.0)})
    with pytest.raises(ValueError, match=r"B \(8, 3\) does not match A's rank 4"):
        pool.place("bad", bad)
    assert len(pool) == 0 and pool.allocated_bytes == 0


def test_full_pool_names_needed_and_free_bytes() -> None:
    pool = AdapterPool(64 * 1024, torch.float32, "cpu")
    w = _adapter(2, rank=16)  # 2 layers x 4 targets at r=16, float32: 47 KiB
    pool.place("a", w)
    need = pool.footprint(w)
    with pytest.raises(PoolFullError) as err:
        pool.place("b", w)
    assert str(err.value) == (
        f"no room for adapter b in the adapter pool: it needs {need} bytes, {pool.free_bytes} of "
        f"{pool.budget_bytes} are free (largest free run {pool.free_bytes} bytes)"
    )
    assert "b" not in pool and pool.allocated_bytes == need
    assert not pool.fits(need) and pool.fits(pool.free_bytes)


def _four_units() -> tuple[AdapterPool, dict[str, AdapterWeights]]:
    """A pool of exactly four equal adapters, the first and third then freed: two one-unit holes."""
    ws = {k: _adapter(i, rank=8) for i, k in enumerate("abcd")}
    unit = AdapterPool(ALIGN, torch.float32, "cpu").footprint(ws["a"])
    pool = AdapterPool(4 * unit, torch.float32, "cpu")
    for k, w in ws.items():
        pool.place(k, w)
    pool.free("a")
    pool.free("c")
    assert pool.free_bytes == 2 * unit and pool.largest_free_extent == unit
    return pool, ws


def _two_units(ws: dict[str, AdapterWeights]) -> AdapterWeights:
    """An adapter exactly as large as two of `_four_units`' adapters."""
    return AdapterWeights({**ws["a"].pairs, **{(layer + 2, t): p for (layer, t), p in ws["c"].pairs.items()}})


def test_compaction_moves_the_cheapest_window_and_reports_it() -> None:
    pool, ws = _four_units()
    big = _two_units(ws)
    assert pool.fits(pool.footprint(big))
    gen_b, gen_d = pool.generation("b"), pool.generation("d")
    placement = pool.place("e", big)
    assert set(placement.moved) == {"b"}  # one adapter moved, not the whole pool
    assert pool.generation("b") == gen_b + 1 and pool.generation("d") == gen_d
    _check_views(pool, placement.moved["b"], ws["b"])
    _check_views(pool, pool.weights("d"), ws["d"])
    _check_views(pool, placement.weights, big)
    assert pool.compactions == 1 and pool.bytes_moved == pool.allocated_of("b") and pool.free_bytes == 0
    pool.check_integrity()


def test_fixed_adapters_are_not_moved() -> None:
    pool, ws = _four_units()
    two_units = _two_units(ws)
    placement = pool.place("e", two_units, fixed={"d"})  # d does not sit in the cheapest window anyway
    assert set(placement.moved) == {"b"}
    pool, ws = _four_units()
    with pytest.raises(PoolFullError, match=r"1 adapters that may not move now \(\d+ bytes\) split it"):
        pool.place("e", two_units, fixed={"b"})
    _check_views(pool, pool.weights("b"), ws["b"])
    _check_views(pool, pool.weights("d"), ws["d"])
    assert len(pool) == 2
    pool.check_integrity()


@pytest.mark.parametrize("shift", [16, 48, 256, 4096, 8192])
def test_overlapping_moves_keep_the_bytes(shift: int) -> None:
    pool = AdapterPool(16384, torch.float16, "cpu")
    n = 8192
    pool.buffer.copy_(torch.arange(pool.buffer.numel()).to(torch.float16))
    expected = pool.buffer[shift // 2 : (shift + n) // 2].clone()
    pool._move(shift, 0, n)
    assert torch.equal(pool.buffer[: n // 2], expected)


@pytest.mark.parametrize("occupancy,cycles", [(0.9, 10_000), (1.0, 1_000)])
def test_any_adapter_loads_when_free_bytes_suffice(occupancy: float, cycles: int) -> None:
    """Seeded load/evict cycles of mixed ranks: evict random adapters until the next one fits
    within `occupancy` of the pool, then it must load, wherever the holes are."""
    rng = random.Random(18)
    pool = AdapterPool(2 << 20, torch.bfloat16, "cpu")
    live: dict[str, AdapterWeights] = {}
    for cycle in range(cycles):
        key = f"r{cycle}"
        w = _adapter(cycle)
        need = pool.footprint(w)
        while pool.allocated_bytes + need > occupancy * pool.budget_bytes:
            victim = rng.choice(sorted(live))
            pool.free(victim)
            del live[victim]
        assert pool.fits(need)
        placement = pool.place(key, w)
        live[key] = w
        for moved, weights in placement.moved.items():
            _check_views(pool, weights, live[moved])
        assert pool.allocated_bytes / pool.used_bytes <= 1.05
        pool.check_integrity()
        if cycle % 1000 == 999:
            for k, ref in live.items():
                _check_views(pool, pool.weights(k), ref)
    assert pool.compactions > 0  # the cycles did fragment the pool
    assert pool.allocated_bytes / pool.budget_bytes > occupancy - 0.1
