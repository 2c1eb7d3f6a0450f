"""The KV block pool on its own: ids handed out and back, and the integrity check that guards them."""

from __future__ import annotations

import random

import pytest

from loraplex.kv.block_pool import BlockPool


def test_a_pool_needs_a_block() -> None:
    for n in (0, -3):
        with pytest.raises(ValueError):
            BlockPool(n)


def test_a_new_pool_is_all_free() -> None:
    pool = BlockPool(5)
    assert (pool.num_blocks, pool.num_free, pool.num_used) == (5, 5, 0)
    pool.check_integrity()


def test_allocating_exactly_what_is_free() -> None:
    pool = BlockPool(6)
    first = pool.allocate(2)
    assert pool.can_allocate(4) and not pool.can_allocate(5)
    rest = pool.allocate(4)
    ids = first + rest
    assert sorted(ids) == list(range(6))  # every block once, no id outside the pool
    assert (pool.num_free, pool.num_used) == (0, 6)
    assert pool.can_allocate(0) and pool.allocate(0) == []
    pool.check_integrity()


def test_allocating_one_more_than_is_free_takes_nothing() -> None:
    pool = BlockPool(6)
    held = pool.allocate(2)
    assert not pool.can_allocate(5)
    with pytest.raises(RuntimeError, match="asked for 5 blocks, 4 free"):
        pool.allocate(5)
    assert (pool.num_free, pool.num_used) == (4, 2)
    pool.check_integrity()
    assert sorted(held + pool.allocate(4)) == list(range(6))  # all 4 still there
    with pytest.raises(RuntimeError):
        pool.allocate(1)


def test_freed_blocks_are_handed_out_again() -> None:
    pool = BlockPool(4)
    a = pool.allocate(3)
    pool.free(a[:2])
    assert (pool.num_free, pool.num_used) == (3, 1)
    again = pool.allocate(3)
    assert set(again) == set(range(4)) - {a[2]}
    pool.free(again + a[2:])
    assert (pool.num_free, pool.num_used) == (4, 0)
    pool.check_integrity()


def test_a_double_free_raises() -> None:
    pool = BlockPool(4)
    blocks = pool.allocate(2)
    pool.free(blocks[:1])
    with pytest.raises(AssertionError, match="freed twice"):
        pool.free(blocks[:1])
    assert (pool.num_free, pool.num_used) == (3, 1)  # the refused free changed nothing
    pool.check_integrity()
    with pytest.raises(AssertionError, match="freed twice"):
        pool.free([blocks[1], blocks[1]])  # twice in one call
    pool.check_integrity()


def test_freeing_a_block_that_was_never_handed_out_raises() -> None:
    pool = BlockPool(4)
    pool.allocate(1)
    for bad in (3, 4, -1):  # free but never allocated; outside the pool; nonsense
        with pytest.raises(AssertionError):
            pool.free([bad])
    assert (pool.num_free, pool.num_used) == (3, 1)
    pool.check_integrity()


def test_integrity_check_catches_a_broken_partition() -> None:
    """Every block id must be exactly one of free or used: corrupt the pool's sets by hand."""
    pool = BlockPool(4)
    pool.allocate(1)
    pool._used.discard(0)  # a block lost: neither free nor used (leaked)
    with pytest.raises(AssertionError):
        pool.check_integrity()

    pool = BlockPool(4)
    pool.allocate(1)
    pool._free.append(0)  # a block both used and free: it would be handed out twice
    with pytest.raises(AssertionError):
        pool.check_integrity()

    pool = BlockPool(4)
    pool.allocate(1)
    pool._used.discard(0)
    pool._free.append(1)  # the count still adds up, but block 0 is lost and block 1 is free twice
    with pytest.raises(AssertionError):
        pool.check_integrity()

    pool = BlockPool(4)
    pool._free[0] = 7  # an id outside the pool
    with pytest.raises(AssertionError):
        pool.check_integrity()


def test_random_allocate_and_free_never_shares_a_block() -> None:
    rnd = random.Random(7)
    pool = BlockPool(32)
    owners: dict[int, list[int]] = {}
    for step in range(2000):
        if owners and (rnd.random() < 0.45 or not pool.can_allocate(1)):
            pool.free(owners.pop(rnd.choice(list(owners))))
        else:
            n = rnd.randint(0, 6)
            if pool.can_allocate(n):
                owners[step] = pool.allocate(n)
            else:
                with pytest.raises(RuntimeError):
                    pool.allocate(n)
        held = [b for blocks in owners.values() for b in blocks]
        assert len(held) == len(set(held)) == pool.num_used
        assert pool.num_free + pool.num_used == 32
    pool.check_integrity()
    for blocks in owners.values():
        pool.free(blocks)
    assert pool.num_free == 32
    pool.check_integrity()
