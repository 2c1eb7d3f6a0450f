"""The prefix cache: full KV blocks found again by a hash chain over their tokens.

A block's hash is sha256(parent hash || its token ids), and the first block's parent is the
request's seed: sha256 over the base revision, the adapter revision (or a base-only marker), the
owner tenant when the adapter is private, and the request's `cache_salt`. K/V depend on every
one of those (the adapter changes q/k/v of every layer), so two requests share a block only when
their weights are the same revisions and the whole prefix up to and including the block is the
same. Names and aliases are never hashed: they move between revisions, and a hash made from a
name would hand one revision's K/V to another. A cryptographic hash, not Python's `hash()`: a
collision would serve another prompt's K/V, and `hash()` is 64 bits and salted per process.

The tenant of a private adapter is in the seed because one content may be registered privately
by two tenants (one revision): without it, one could tell from its time to first token whether
the other sent a prompt. `cache_salt` goes further: only requests with the same salt share.

Reads happen when a waiting sequence is admitted (`lookup`, then `admit`): the longest run of
cached blocks from the start, leaving at least one token to compute (its logits are sampled).
Requests that want prompt logprobs read nothing (their rows must be computed to be scored) but
write. Writes (`commit`) happen once a block is full and its K/V are computed: the scheduler
commits a sequence's blocks when it plans its next block or chunk, its first decode row, and
before it frees them (finish, abort, preemption), so a preempted sequence finds its own blocks
again unless they were evicted meanwhile.
"""

from __future__ import annotations

import hashlib
from array import array
from dataclasses import dataclass
from typing import TYPE_CHECKING

from loraplex.adapters.registry import RegisteredRevision
from loraplex.kv.block_pool import BlockPool

if TYPE_CHECKING:
    from loraplex.engine.sequence import Sequence

_VERSION = b"loraplex-prefix-cache/1"
_BASE_ONLY = "base-only"  # the adapter field of a base model request's seed (never a revision's form)


def prefix_seed(
    base_revision: str, adapter_revision: str | None, private_tenant: str | None, cache_salt: str | None
) -> bytes:
    """The hash the chain of a request's blocks starts from. Every field is length-prefixed, so no
    two different field tuples give the same bytes."""
    h = hashlib.sha256(_VERSION)
    fields = (
        base_revision,
        "adapter:" + adapter_revision if adapter_revision is not None else _BASE_ONLY,
        "tenant:" + private_tenant if private_tenant is not None else "shared",
        "salt:" + cache_salt if cache_salt is not None else "unsalted",
    )
    for field in fields:
        data = field.encode()
        h.update(len(data).to_bytes(8, "little"))
        h.update(data)
    return h.digest()


def block_hash(parent: bytes, token_ids: list[int]) -> bytes:
    """The hash of a full block: its parent's hash and its token ids (8 bytes each, in the
    machine's order: hashes never leave the process). An array packs the ids in C, a third of
    what converting them one by one costs (2.3 against 6.1 us per 16-token block)."""
    h = hashlib.sha256(parent)
    h.update(array("q", token_ids).tobytes())
    return h.digest()


@dataclass
class PrefixCacheStats:
    """Counted at each admission while the cache is on (preempted sequences count again)."""

    queries: int = 0  # admissions
    query_blocks: int = 0  # full blocks a hit could have covered (all but the last token)
    hit_blocks: int = 0
    query_tokens: int = 0  # known tokens of the admitted sequences
    hit_tokens: int = 0  # of those, tokens whose K/V came from the cache

    @property
    def block_hit_rate(self) -> float:
        return self.hit_blocks / self.query_blocks if self.query_blocks else 0.0

    @property
    def token_hit_rate(self) -> float:
        return self.hit_tokens / self.query_tokens if self.query_tokens else 0.0


class PrefixCache:
    def __init__(self, pool: BlockPool, block_size: int) -> None:
        self.pool = pool
        self.block_size = block_size
        self.stats = PrefixCacheStats()
        self._base_field: str | None = None

    def seed(
        self, base_revision: str | None, adapter: RegisteredRevision | None, cache_salt: str | None
    ) -> bytes:
        """A request's seed from its adapter's registered revision (None: the base model): the
        revision, and the owner tenant when the adapter is private. The base field is fixed at
        the first request for the cache's life: the base revision when it is known by then
        (always in a server, which hashes it at startup), else a marker, so that an offline engine
        serving only the base never hashes gigabytes of weights for its first prompt. One cache
        serves one loaded base, so either tells it apart equally; fixing it keeps the base's
        blocks reachable once the revision becomes known."""
        if self._base_field is None:
            self._base_field = base_revision or "unidentified-base"
        if adapter is None:
            return prefix_seed(self._base_field, None, None, cache_salt)
        private = adapter.tenant if adapter.visibility == "private" else None
        return prefix_seed(self._base_field, adapter.ref.revision, private, cache_salt)

    def lookup(self, seq: Sequence) -> list[int]:
        """The cached blocks a waiting sequence (no blocks, nothing computed) may start from; not
        held yet (`admit` takes them)."""
        if seq.cache_seed is None or seq.params.prompt_logprobs is not None:
            return []
        pool = self.pool
        limit = (seq.num_tokens - 1) // self.block_size  # leave the last token to compute
        hits: list[int] = []
        for h in self._hashes(seq, limit):
            b = pool.lookup(h)
            if b is None:
                break
            hits.append(b)
        return hits

    def num_unheld(self, blocks: list[int]) -> int:
        """How many of `blocks` are cached but unheld: taking them shrinks the pool's free count."""
        is_held = self.pool.is_held
        return sum(not is_held(b) for b in blocks)

    def admit(self, seq: Sequence, hits: list[int]) -> None:
        """Hold the hit blocks for `seq` (before new blocks are allocated, which could evict them)
        and mark their tokens computed; count the admission."""
        for b in hits:
            self.pool.acquire(b)
        seq.block_ids = list(hits)
        seq.num_committed_blocks = len(hits)
        seq.num_computed = len(hits) * self.block_size
        if not seq.num_preemptions:  # what the request's usage reports: its first admission's hit
            seq.num_cached_tokens = seq.num_computed
        s = self.stats
        s.queries += 1
        s.query_blocks += (seq.num_tokens - 1) // self.block_size
        s.hit_blocks += len(hits)
        s.query_tokens += seq.num_tokens
        s.hit_tokens += seq.num_computed

    def commit(self, seq: Sequence) -> None:
        """Hash the sequence's full, computed blocks not handed to the cache yet."""
        full = seq.num_computed // self.block_size
        done = seq.num_committed_blocks
        if full <= done or seq.cache_seed is None:
            return
        hashes = self._hashes(seq, full)
        tag = seq.adapter.revision if seq.adapter is not None else None
        cache, table = self.pool.cache, seq.block_ids
        for i in range(done, full):
            cache(table[i], hashes[i], tag)
        seq.num_committed_blocks = full

    def drop_revision(self, revision: str) -> int:
        """Forget every block computed under an adapter revision (it left service)."""
        return self.pool.uncache(revision)

    def _hashes(self, seq: Sequence, n: int) -> list[bytes]:
        """The chain hashes of the sequence's first `n` blocks (all full), extending the ones kept
        on the sequence: a token's block never changes, so each is hashed once."""
        hashes = seq.block_hashes
        bs = self.block_size
        assert seq.cache_seed is not None
        parent = hashes[-1] if hashes else seq.cache_seed
        for i in range(len(hashes), n):
            parent = block_hash(parent, seq.tokens_between(i * bs, (i + 1) * bs))
            hashes.append(parent)
        return hashes[:n] if len(hashes) > n else hashes
