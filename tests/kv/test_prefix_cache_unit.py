"""The prefix cache without a model: seeds, the hash chain, and a scheduler driven through random
arrivals, aborts and preemptions with the KV accounting contract checked after every step."""

from __future__ import annotations

import itertools
import random

import pytest

from loraplex.config import SchedulerConfig
from loraplex.engine.scheduler import Scheduler
from loraplex.engine.sequence import Sequence
from loraplex.kv.accounting import check_kv_accounting
from loraplex.kv.block_pool import BlockPool
from loraplex.kv.prefix_cache import PrefixCache, block_hash, prefix_seed
from loraplex.types import AdapterRef, SamplingParams

BS = 4


def test_every_seed_field_counts_and_fields_cannot_run_together() -> None:
    seeds = {
        prefix_seed(base, adapter, tenant, salt)
        for base in ("sha256:aa", "sha256:ab")
        for adapter in (None, "0" * 64, "1" * 64)
        for tenant in (None, "t1", "t2")
        for salt in (None, "", "x")
    }
    assert len(seeds) == 2 * 3 * 3 * 3
    # length-prefixed: moving a character from one field to the next is another seed
    assert prefix_seed("ab", "c", None, None) != prefix_seed("a", "bc", None, None)
    assert prefix_seed("b", None, None, "adapter:x") != prefix_seed("b", "x", None, None)


def test_the_chain_depends_on_the_whole_prefix() -> None:
    s = prefix_seed("b", None, None, None)
    one = block_hash(s, [1, 2, 3, 4])
    assert len(one) == 32 and one == block_hash(s, [1, 2, 3, 4])
    assert block_hash(one, [5, 6, 7, 8]) != block_hash(block_hash(s, [1, 2, 3, 9]), [5, 6, 7, 8])
    assert block_hash(s, [1, 2, 3, 4]) != block_hash(s, [4, 3, 2, 1])
    assert block_hash(s, [256]) != block_hash(s, [1, 0])  # ids are not bytes


@pytest.mark.parametrize("seed", range(4))
def test_random_workload_keeps_the_accounting_and_shares_only_within_a_seed(seed: int) -> None:
    rnd = random.Random(seed)
    pool = BlockPool(10)
    prefix = PrefixCache(pool, BS)
    sched = Scheduler(SchedulerConfig(max_num_seqs=6, max_num_batched_tokens=20), pool, BS, prefix=prefix)
    adapters = [None, AdapterRef("a", "0" * 64), AdapterRef("b", "1" * 64)]
    stems = [[rnd.randrange(3, 50) for _ in range(12)] for _ in range(3)]
    arrivals = itertools.count()
    live: list[Sequence] = []
    owner: dict[int, bytes] = {}  # block -> seed of the sequence that computed it
    preempted = hits = 0
    for step in range(400):
        if step < 300 and rnd.random() < 0.35:
            adapter = rnd.choice(adapters)
            salt = rnd.choice([None, None, "s"])
            prompt = rnd.choice(stems)[: rnd.randint(4, 12)] + [
                rnd.randrange(3, 50) for _ in range(rnd.randint(0, 6))
            ]
            seq = Sequence(
                f"s{step}", prompt, SamplingParams(max_tokens=rnd.randint(1, 20)), adapter, next(arrivals)
            )
            seq.cache_seed = prefix_seed("base", adapter.revision if adapter else None, None, salt)
            live.append(seq)
            sched.add(seq)
        if live and rnd.random() < 0.05:  # an abort at any point
            victim = rnd.choice(live)
            sched.finish(victim)
            live.remove(victim)
        before = prefix.stats.hit_blocks
        plan = sched.schedule()
        hits += prefix.stats.hit_blocks - before
        preempted += len(plan.preempted)
        for c in plan.chunks:
            seq = c.seq
            assert seq.cache_seed is not None
            for b in seq.block_ids[: seq.num_computed // BS]:  # blocks it reads: same seed only
                assert owner.get(b, seq.cache_seed) == seq.cache_seed, "a block crossed seeds"
            for i in range(seq.num_computed // BS, len(seq.block_ids)):
                owner[seq.block_ids[i]] = seq.cache_seed  # rows it writes this step
            seq.num_computed += c.num_tokens
        for c in plan.chunks:
            seq = c.seq
            if seq.num_computed == seq.num_tokens:
                seq.output_token_ids.append(rnd.randrange(3, 50))
                if len(seq.output_token_ids) >= seq.params.max_tokens:
                    sched.finish(seq)
                    live.remove(seq)
        check_kv_accounting(pool, live, BS, lambda _revision: True)
    assert preempted > 0 and hits > 0, (preempted, hits)
    for seq in list(live):
        sched.finish(seq)
    check_kv_accounting(pool, [], BS, lambda _revision: True)
    assert pool.num_used == 0 and pool.num_free == pool.num_blocks
