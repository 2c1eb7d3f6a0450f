"""Which device-resident adapters a placement evicts to make room (the tiers' victim choice).

The eviction policy (adapters/eviction.py) ranks candidates; this module says who the candidates
are and how each is protected right now: the adapters of running sequences are never victims,
those that queued sequences wait for only when nothing else makes room and nothing runs (else the
queue could deadlock), one placed since the current `poll` began is kept for a step, and a
starved request's drained slot (engine/slot_drain.py) is that request's load alone.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable, Mapping

from loraplex.adapters.device_pool import AdapterPool
from loraplex.adapters.eviction import Candidate, EvictionPolicy, Tier
from loraplex.adapters.host_cache import HostCache
from loraplex.adapters.residency import AdapterResidency
from loraplex.types import AdapterRef

# What the engine reports of its live sequences when a placement needs victims: the adapters of
# the running sequences and of the waiting ones.
Demand = Callable[[], tuple[Iterable[AdapterRef | None], Iterable[AdapterRef | None]]]


def victims_for(
    revision: str,
    size: int,
    demand: Demand,
    reserved: tuple[str | None, str | None],
    tenant_of: Mapping[str, str],
    placed: set[str],
    pool: AdapterPool,
    host: HostCache,
    residency: AdapterResidency,
    policy: EvictionPolicy,
    now: float,
) -> list[str] | None:
    """The revisions to evict so that `size` more bytes fit for `revision`; None: no choice does.
    `reserved`: (a starved request's revision, the revision drained for it) or (None, None)."""
    running, waiting = demand()
    refs = Counter(a.revision for a in running if a is not None)
    queued = Counter(a.revision for a in waiting if a is not None)
    starved, drained = reserved
    if drained is not None:  # a victim for the starved load (its queued requests wait), else kept
        if revision == starved:
            queued.pop(drained, None)
        else:
            refs[drained] += 1
    tenant = tenant_of.get(revision, "")

    def candidates(protect_queued: bool) -> list[Candidate]:
        return [
            Candidate(
                r,
                tenant_of.get(r, ""),
                pool.allocated_of(r),
                Tier.HOST if r in host else Tier.DISK,
                references=refs[r] + (r in placed),  # placed just now: kept for a step
                queued=queued[r] if protect_queued else 0,
            )
            for r in residency.resident_revisions()
        ]

    choice = policy.choose_victims(size, pool.free_bytes, candidates(True), tenant, now)
    if not choice.ok and not refs:
        # Nothing runs, so nothing will finish and free room: waiting for the queued adapters'
        # requests would wait forever. Take from those instead.
        choice = policy.choose_victims(size, pool.free_bytes, candidates(False), tenant, now)
    return list(choice.victims) if choice.ok else None
