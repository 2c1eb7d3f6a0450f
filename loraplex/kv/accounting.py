"""The KV accounting contract with shared, reference-counted blocks (docs/architecture.md, "KV
accounting"), checked between steps by `Engine.check_integrity`."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from typing import TYPE_CHECKING

from loraplex.kv.block_pool import BlockPool

if TYPE_CHECKING:
    from loraplex.engine.sequence import Sequence


def check_kv_accounting(
    pool: BlockPool, live: list[Sequence], block_size: int, in_service: Callable[[str], bool]
) -> None:
    """Assert that, between steps:

    - the pool's held / free / cached states partition its blocks (`BlockPool.check_integrity`);
    - each live sequence's table covers exactly its computed tokens and lists no block twice;
    - each block's reference count equals the number of live tables listing it, so the blocks in
      use are exactly the union of those tables (nothing leaked, nothing freed while listed);
    - a block listed by more than one table is full and computed in each (a shared block is
      never written again: two sequences writing one block would mix their K/V);
    - a sequence has committed no more blocks than it has full, computed ones;
    - every cached hash belongs to the base or to an adapter revision still in service (a drained
      revision's blocks were dropped).
    """
    pool.check_integrity()
    holders: Counter[int] = Counter()
    for seq in live:
        table = seq.block_ids
        assert len(table) == len(set(table)), f"{seq.request_id} lists a block twice"
        assert len(table) == -(-seq.num_computed // block_size), f"{seq.request_id}: blocks vs computed"
        assert seq.num_committed_blocks <= seq.num_computed // block_size, f"{seq.request_id}: commits"
        holders.update(table)
    assert pool.num_used == len(holders), "KV blocks leaked"
    for b in range(pool.num_blocks):
        assert pool.ref_count(b) == holders.get(b, 0), f"block {b}: reference count vs holders"
    for seq in live:
        full = seq.num_computed // block_size
        for i, b in enumerate(seq.block_ids):
            assert holders[b] == 1 or i < full, f"block {b} is shared but {seq.request_id} writes it"
    for tag in pool.tags():
        assert tag is None or in_service(tag), f"cached blocks of revision {tag[:12]} outlived it"
