"""KV block pool: hands out block ids. Pure bookkeeping over integers, no tensors."""

from __future__ import annotations

from collections import deque


class BlockPool:
    def __init__(self, num_blocks: int) -> None:
        if num_blocks <= 0:
            raise ValueError("the KV pool needs at least one block")
        self.num_blocks = num_blocks
        self._free: deque[int] = deque(range(num_blocks))
        self._used: set[int] = set()

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return len(self._used)

    def can_allocate(self, n: int) -> bool:
        return n <= len(self._free)

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise RuntimeError(f"KV pool exhausted: asked for {n} blocks, {len(self._free)} free")
        blocks = [self._free.popleft() for _ in range(n)]
        self._used.update(blocks)
        return blocks

    def free(self, blocks: list[int]) -> None:
        for b in blocks:
            # A double free would hand one block to two sequences: their KV would silently mix.
            assert b in self._used, f"block {b} freed twice"
            self._used.remove(b)
            self._free.append(b)

    def check_integrity(self) -> None:
        assert len(self._used) + len(self._free) == self.num_blocks
        assert not self._used.intersection(self._free)
        # With the count above, this also rules out an id free twice or one outside the pool,
        # which the two checks above let through when a lost block makes room for it.
        assert self._used.union(self._free) == set(range(self.num_blocks)), "free/used ids are not the pool's"
