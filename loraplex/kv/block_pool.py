"""KV block pool: hands out block ids, counts who holds each one, and keeps the blocks the prefix
cache knows (a block hash -> block id map) until their room is needed. Pure bookkeeping over
integers, no tensors.

Every block is in exactly one state:

- held: its reference count is > 0 (one per sequence whose block table lists it);
- free: count 0 and no hash; handed out first;
- cached: count 0 with a hash; its K/V are kept for a later request with the same prefix, and its
  room is taken back, least recently freed first, when no free block is left.

A held block may carry a hash too (a full block the prefix cache knows); it then becomes cached,
not free, when its last holder lets go. `num_free` counts free and cached blocks: both can be
handed out now.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable


class BlockPool:
    def __init__(self, num_blocks: int) -> None:
        if num_blocks <= 0:
            raise ValueError("the KV pool needs at least one block")
        self.num_blocks = num_blocks
        self._refs = [0] * num_blocks
        self._num_held = 0
        self._free: deque[int] = deque(range(num_blocks))
        # Unreferenced blocks with a hash, least recently freed first (a dict keeps insertion order
        # and removes a block from the middle in O(1) when a prefix hit takes it back).
        self._cached: dict[int, None] = {}
        self._hash_of: dict[int, bytes] = {}
        self._block_of: dict[bytes, int] = {}
        self._tag_of: dict[int, str | None] = {}  # the adapter revision a hash belongs to (None: base)
        self.evictions = 0  # cached blocks whose room was taken back

    @property
    def num_free(self) -> int:
        """Blocks that can be handed out now: free ones, then cached ones (evicted on the way)."""
        return len(self._free) + len(self._cached)

    @property
    def num_used(self) -> int:
        """Blocks some sequence holds."""
        return self._num_held

    @property
    def num_cached(self) -> int:
        """Blocks with a hash, held or not."""
        return len(self._hash_of)

    def can_allocate(self, n: int) -> bool:
        return n <= self.num_free

    def allocate(self, n: int) -> list[int]:
        """`n` blocks held once each: free blocks first, then the least recently freed cached ones
        (which lose their hash)."""
        if n > self.num_free:
            raise RuntimeError(f"KV pool exhausted: asked for {n} blocks, {self.num_free} free")
        blocks = []
        free, cached, refs = self._free, self._cached, self._refs
        for _ in range(n):
            if free:
                b = free.popleft()
            else:
                b = next(iter(cached))
                del cached[b]
                self._forget(b)
                self.evictions += 1
            refs[b] = 1
            blocks.append(b)
        self._num_held += n
        return blocks

    def free(self, blocks: Iterable[int]) -> None:
        """Let go of one hold on each block. A block nobody holds any more becomes cached if it has
        a hash (most recently freed: evicted last), free otherwise. Callers free a sequence's blocks
        last first, so its tail is evicted before the prefix other requests are likelier to share."""
        refs = self._refs
        for b in blocks:
            # A double free would hand one block to two sequences: their KV would silently mix.
            assert 0 <= b < self.num_blocks and refs[b] > 0, f"block {b} freed twice"
            refs[b] -= 1
            if refs[b] == 0:
                self._num_held -= 1
                if b in self._hash_of:
                    self._cached[b] = None
                else:
                    self._free.append(b)

    # --- the prefix cache's side -----------------------------------------------------------------

    def lookup(self, block_hash: bytes) -> int | None:
        """The block holding the K/V of the prefix with this hash, if any."""
        return self._block_of.get(block_hash)

    def is_held(self, block: int) -> bool:
        return self._refs[block] > 0

    def acquire(self, block: int) -> None:
        """One more hold on a block with a hash (a prefix hit); a cached one stops being evictable."""
        assert block in self._hash_of, f"block {block} has no hash: it cannot be shared"
        if self._refs[block] == 0:
            del self._cached[block]
            self._num_held += 1
        self._refs[block] += 1

    def cache(self, block: int, block_hash: bytes, tag: str | None) -> bool:
        """Give a held, full block its hash. False (nothing changes) when another block already has
        that hash (two requests computed the same prefix at once: the first keeps it) or this block
        has one."""
        assert self._refs[block] > 0, f"block {block} is not held"
        if block_hash in self._block_of or block in self._hash_of:
            return False
        self._hash_of[block] = block_hash
        self._block_of[block_hash] = block
        self._tag_of[block] = tag
        return True

    def uncache(self, tag: str | None) -> int:
        """Drop the hash of every block tagged `tag` (a retired adapter revision): cached ones become
        free, held ones are freed as plain blocks later. Returns how many hashes were dropped."""
        doomed = [b for b, t in self._tag_of.items() if t == tag]
        for b in doomed:
            self._forget(b)
            if b in self._cached:
                del self._cached[b]
                self._free.append(b)
        return len(doomed)

    def tags(self) -> set[str | None]:
        """The tags some block's hash carries."""
        return set(self._tag_of.values())

    def ref_count(self, block: int) -> int:
        return self._refs[block]

    def _forget(self, block: int) -> None:
        del self._block_of[self._hash_of.pop(block)]
        del self._tag_of[block]

    def check_integrity(self) -> None:
        """Every block is exactly one of held, free or cached; hashes map one-to-one to blocks."""
        n = self.num_blocks
        assert len(self._refs) == n and all(r >= 0 for r in self._refs), "reference counts"
        held = {b for b in range(n) if self._refs[b] > 0}
        free = list(self._free)
        cached = list(self._cached)
        assert len(free) == len(set(free)), "a block is free twice"
        assert all(0 <= b < n for b in free + cached), "free/cached ids are not the pool's"
        assert len(held) == self._num_held, "held count"
        assert not held.intersection(free) and not held.intersection(cached), "a held block is also free"
        assert not set(free).intersection(cached), "a block is both free and cached"
        # With the count above, this rules out a lost block (neither held, free nor cached).
        assert len(held) + len(free) + len(cached) == n, "free/held/cached do not partition the pool"
        assert len(self._hash_of) == len(self._block_of) == len(self._tag_of), "hash maps"
        assert all(self._block_of[h] == b for b, h in self._hash_of.items()), "hash maps disagree"
        assert all(b in self._hash_of for b in cached), "a cached block has no hash"
        assert all(b not in self._hash_of for b in free), "a free block still has a hash"
