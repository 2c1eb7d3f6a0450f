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
    """Every block id must be exactly one of held, free or cached: corrupt the pool by hand."""
    pool = BlockPool(4)
    pool.allocate(1)
    pool._refs[0] = 0  # a block lost: neither held, free nor cached (leaked)
    with pytest.raises(AssertionError):
        pool.check_integrity()

    pool = BlockPool(4)
    pool.allocate(1)
    pool._free.append(0)  # a block both held and free: it would be handed out twice
    with pytest.raises(AssertionError):
        pool.check_integrity()

    pool = BlockPool(4)
    pool.allocate(1)
    pool._refs[0] = 0
    pool._num_held = 0
    pool._free.append(1)  # the count still adds up, but block 0 is lost and block 1 is free twice
    with pytest.raises(AssertionError):
        pool.check_integrity()

    pool = BlockPool(4)
    pool._free[0] = 7  # an id outside the pool
    with pytest.raises(AssertionError):
        pool.check_integrity()

    pool = BlockPool(4)
    (b,) = pool.allocate(1)
    pool.cache(b, b"h", None)
    pool.free([b])
    pool._free.append(b)  # both cached and free
    with pytest.raises(AssertionError):
        pool.check_integrity()

    pool = BlockPool(4)
    (b,) = pool.allocate(1)
    pool.cache(b, b"h", None)
    pool._block_of[b"h"] = 3  # the two maps disagree: a lookup would hand out the wrong block
    with pytest.raises(AssertionError):
        pool.check_integrity()


# --- cached blocks ---------------------------------------------------------------------------------


def test_a_freed_block_with_a_hash_stays_cached_until_its_room_is_needed() -> None:
    pool = BlockPool(3)
    a, b, c = pool.allocate(3)
    assert pool.cache(a, b"ha", None) and pool.cache(b, b"hb", "rev")
    pool.free([c, b, a])  # c plain free; b, then a cached (a most recently freed)
    assert (pool.num_free, pool.num_used, pool.num_cached) == (3, 0, 2)
    assert pool.lookup(b"ha") == a and pool.lookup(b"hb") == b
    pool.check_integrity()
    assert pool.allocate(1) == [c]  # a free block before any cached one
    assert pool.num_cached == 2 and pool.evictions == 0
    assert pool.allocate(1) == [b]  # then the least recently freed cached block, losing its hash
    assert pool.lookup(b"hb") is None and pool.lookup(b"ha") == a and pool.evictions == 1
    pool.check_integrity()


def test_a_hit_takes_a_cached_block_back_and_shares_a_held_one() -> None:
    pool = BlockPool(2)
    (a,) = pool.allocate(1)
    pool.cache(a, b"ha", None)
    pool.acquire(a)  # a second holder while the first still holds it
    assert pool.ref_count(a) == 2 and pool.num_used == 1
    pool.free([a])
    assert pool.ref_count(a) == 1 and pool.num_free == 1
    pool.free([a])
    assert pool.num_free == 2 and pool.num_cached == 1
    pool.acquire(a)  # from the cached list: no longer evictable
    assert pool.num_free == 1 and pool.num_used == 1
    assert pool.allocate(1) != [a]
    pool.check_integrity()
    with pytest.raises(AssertionError, match="no hash"):
        pool.acquire(1 - a)


def test_one_hash_one_block() -> None:
    pool = BlockPool(3)
    a, b, _ = pool.allocate(3)
    assert pool.cache(a, b"h", None)
    assert not pool.cache(b, b"h", None)  # computed twice at once: the first keeps the hash
    assert not pool.cache(a, b"other", None)  # a block has one hash
    pool.free([b])
    assert pool.num_cached == 1 and b in pool._free  # b had no hash: plain free
    pool.check_integrity()


def test_uncache_drops_one_tags_blocks_held_or_not() -> None:
    pool = BlockPool(4)
    a, b, c, d = pool.allocate(4)
    pool.cache(a, b"a", "r1")
    pool.cache(b, b"b", "r1")
    pool.cache(c, b"c", "r2")
    pool.cache(d, b"d", None)
    pool.free([a, c, d])  # b stays held
    assert pool.uncache("r1") == 2
    assert pool.lookup(b"a") is None and pool.lookup(b"b") is None and pool.lookup(b"c") == c
    assert pool.tags() == {"r2", None} and a in pool._free
    pool.check_integrity()
    pool.free([b])  # held when its hash went: freed as a plain block
    assert b in pool._free and pool.num_cached == 2
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
