"""Admission-order policies: which waiting sequence the scheduler tries next.

The scheduler (engine/scheduler.py) owns the step: the token budget, chunked prefill, decode rows,
KV space, the adapter-ready gate and preemption (whose victims the decode policy picks,
engine/decode_policies.py). An admission policy owns only the waiting queue and its order, so
policies compose with all of that instead of copying it. Each step the scheduler asks
`candidates(now)` for a bounded run of waiting sequences in the order to try them, admits what fits,
and reports back: `take` (admitted), `started`/`stopped` (entered / left the running set) and
`charge` (rows planned for a sequence).

fcfs      arrival order (preempted sequences go back to their arrival position); today's behavior.
adaptive  adapter-aware and fair (`AdaptivePolicy`): per-tenant virtual token counters, priority,
          deadlines, an adapter-locality window, a cap on distinct adapters, a starvation bound.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections import Counter
from collections.abc import Callable, Iterator
from collections.abc import Sequence as SeqView
from typing import Any, Protocol

from loraplex.config import SchedulerConfig
from loraplex.engine.sequence import Sequence

# Adapters' arrival rates are decayed counts over about this long; the rate that makes an adapter
# one of the most requested is recomputed at most this often (so a hold check stays O(1)).
_RATE_TAU_S = 10.0
_TOP_REFRESH_S = 0.1


class AdmissionPolicy(Protocol):
    # The policy charges service (`charge`) only if this is true; FCFS skips the per-chunk calls.
    charges: bool
    waiting: SeqView[Sequence]  # in the policy's own order of keeping (`Scheduler.waiting`)

    def push(self, seq: Sequence) -> None: ...
    def remove(self, seq: Sequence) -> None: ...
    def take(self, seq: Sequence) -> None: ...
    def candidates(self, now: float, limit: int) -> Iterator[Sequence]: ...
    def blocks(self, seq: Sequence, now: float) -> bool: ...
    def urgent(self, seq: Sequence, now: float) -> bool: ...
    def started(self, seq: Sequence) -> None: ...
    def stopped(self, seq: Sequence) -> None: ...
    def charge(self, seq: Sequence, rows: int) -> None: ...
    def __len__(self) -> int: ...
    def __iter__(self) -> Iterator[Sequence]: ...


class FCFSPolicy:
    """Arrival order, exactly as the scheduler always did it; the list is the waiting queue."""

    charges = False

    def __init__(self) -> None:
        self.queue: list[Sequence] = []  # sorted by arrival
        self.waiting = self.queue

    def push(self, seq: Sequence) -> None:
        pos = len(self.queue)
        while pos > 0 and self.queue[pos - 1].arrival > seq.arrival:
            pos -= 1
        self.queue.insert(pos, seq)

    def remove(self, seq: Sequence) -> None:
        self.queue.remove(seq)

    def take(self, seq: Sequence) -> None:
        self.queue.remove(seq)  # admitted ones come from the front: found at once

    def candidates(self, now: float, limit: int) -> Iterator[Sequence]:
        return iter(self.queue[:limit])  # a copy: `take` changes the list while the caller iterates

    def blocks(self, seq: Sequence, now: float) -> bool:
        return False  # one whose adapter is loading is passed over

    def urgent(self, seq: Sequence, now: float) -> bool:
        return False

    def started(self, seq: Sequence) -> None:
        pass

    def stopped(self, seq: Sequence) -> None:
        pass

    def charge(self, seq: Sequence, rows: int) -> None:
        pass

    def __len__(self) -> int:
        return len(self.queue)

    def __iter__(self) -> Iterator[Sequence]:
        return iter(self.queue)


def adapter_key(seq: Sequence) -> str | None:
    """The adapter revision a sequence runs on (None: the base model)."""
    return None if seq.adapter is None else seq.adapter.revision


class AdaptivePolicy:
    """Adapter-aware, fair admission. Order of a step's candidates:

    1. urgent: sequences whose TTFT deadline is less than `deadline_slack_ms` away, earliest first.
       They skip the locality window and the adapter cap: a deadline is what mixes them in.
    2. the rest by tenant fairness: the backlogged tenant with the least weighted service (virtual
       token counter: rows planned for it / its weight) goes next. Within a tenant, its oldest
       request if it waited `max_wait_ms` or more (the starvation bound), else the highest
       priority, then arrival. The locality window applies to the latter: a sequence whose adapter
       is neither running nor already picked this step, nor ran within `locality_popular_ms` (or
       the window, if longer), waits up to `locality_window_ms` for same-adapter company (admitted
       at once when `locality_group` of its adapter wait), and no
       step admits a new adapter beyond `max_adapters_per_step` distinct ones.

    The starvation bound is per tenant because across tenants fairness is the bound: a tenant
    asking more than its share waits for its own backlog, and making its old requests go first
    across tenants would hand a flood the whole machine again. A starved request whose adapter is
    not ready (`blocks`) has the scheduler drain one running adapter to free a slot for its load
    (engine/slot_drain.py); otherwise a stream of ready work could pass it over forever.

    Per step the work is bounded by the candidates looked at (`limit`) and the number of tenants,
    never the queue length: per-tenant heaps with lazy deletion, a deadline heap, an arrival-ordered
    dict for the starvation check.
    """

    charges = True

    def __init__(self, config: SchedulerConfig, clock: Callable[[], float]) -> None:
        self._clock = clock
        self.window = config.locality_window_ms / 1000
        self.group = config.locality_group
        # an adapter that ran this recently is popular, not a stray: its requests are never held
        self.popular = max(config.locality_popular_ms / 1000, self.window)
        self.max_adapters = config.max_adapters_per_step or config.max_num_seqs
        self.max_wait = config.max_wait_ms / 1000
        self.slack = config.deadline_slack_ms / 1000
        self.weights = parse_weights(config.tenant_weights)
        self._tick = itertools.count()  # heap tie-break, so sequences are never compared
        self._waiting: dict[Sequence, None] = {}  # insertion (about arrival) order
        self._tenant_waiting: dict[str, dict[Sequence, None]] = {}  # per tenant, oldest first
        self._by_tenant: dict[str, list[tuple[int, int, int, Sequence]]] = {}
        self._deadlines: list[tuple[float, int, Sequence]] = []
        self._vtc: dict[str, float] = {}
        self._live: Counter[str] = Counter()  # tenant -> waiting + running sequences
        self._running_adapters: Counter[str] = Counter()
        self._last_ran: dict[str, float] = {}  # adapter -> when a sequence of it last left the running set
        self._waiting_adapters: Counter[str] = Counter()
        # adapter -> (arrivals decayed with time constant _RATE_TAU_S, when last updated)
        self._arrivals: dict[str, tuple[float, float]] = {}
        self.top_share = config.locality_top_share
        self._top_floor, self._top_at = math.inf, -math.inf  # the top share's lowest decayed count
        self.waiting = _View(self._waiting)

    # --- the queue -------------------------------------------------------------------------------
    def push(self, seq: Sequence) -> None:
        tenant = seq.tenant
        if self._live[tenant] == 0:
            # A tenant that becomes active starts at the least active counter: idle time banks no
            # credit it could later spend starving the others.
            floor = min((v for t, v in self._vtc.items() if self._live[t]), default=0.0)
            self._vtc[tenant] = max(self._vtc.get(tenant, 0.0), floor)
        self._live[tenant] += 1
        self._waiting[seq] = None
        self._tenant_waiting.setdefault(tenant, {})[seq] = None
        heapq.heappush(
            self._by_tenant.setdefault(tenant, []), (-seq.priority, seq.arrival, next(self._tick), seq)
        )
        if seq.deadline is not None:
            heapq.heappush(self._deadlines, (seq.deadline, next(self._tick), seq))
        key = adapter_key(seq)
        if key is not None:
            self._waiting_adapters[key] += 1
            now = self._clock()
            self._arrivals[key] = (self._decayed(key, now) + 1.0, now)

    def remove(self, seq: Sequence) -> None:
        """A waiting sequence leaves for good (aborted); heap entries are dropped lazily."""
        self._unqueue(seq)
        self._live[seq.tenant] -= 1

    def take(self, seq: Sequence) -> None:
        self._unqueue(seq)

    def _unqueue(self, seq: Sequence) -> None:
        del self._waiting[seq]
        del self._tenant_waiting[seq.tenant][seq]
        key = adapter_key(seq)
        if key is not None:
            self._waiting_adapters[key] -= 1

    def started(self, seq: Sequence) -> None:
        key = adapter_key(seq)
        if key is not None:
            self._running_adapters[key] += 1

    def stopped(self, seq: Sequence) -> None:
        """Left the running set: finished, aborted or preempted (then `push` follows)."""
        key = adapter_key(seq)
        if key is not None:
            self._running_adapters[key] -= 1
            self._last_ran[key] = self._clock()
        self._live[seq.tenant] -= 1

    def charge(self, seq: Sequence, rows: int) -> None:
        self._vtc[seq.tenant] += rows / self.weights.get(seq.tenant, 1.0)

    def blocks(self, seq: Sequence, now: float) -> bool:
        """Whether room is to be made for it when its adapter is not resident: starved, or urgent."""
        return now - seq.waiting_since >= self.max_wait or self.urgent(seq, now)

    def urgent(self, seq: Sequence, now: float) -> bool:
        """Its TTFT deadline is less than `deadline_slack_ms` away (it goes before fairness)."""
        return seq.deadline is not None and seq.deadline - now <= self.slack

    def __len__(self) -> int:
        return len(self._waiting)

    def __iter__(self) -> Iterator[Sequence]:
        return iter(self._waiting)

    # --- the order -------------------------------------------------------------------------------
    def candidates(self, now: float, limit: int) -> Iterator[Sequence]:
        seen: set[Sequence] = set()
        yield from self._urgent(now, seen, limit)
        yield from self._fair(now, seen, limit)

    def _urgent(self, now: float, seen: set[Sequence], limit: int) -> Iterator[Sequence]:
        heap, later = self._deadlines, []
        try:
            while heap and heap[0][0] - now <= self.slack and len(seen) < limit:
                entry = heapq.heappop(heap)
                seq = entry[2]
                if seq not in self._waiting:
                    continue  # admitted or aborted since: a stale entry
                later.append(entry)  # kept until it is admitted (it may not fit this step)
                if seq not in seen:
                    seen.add(seq)
                    yield seq
        finally:  # also when the scheduler stops the pass here (closing the generator)
            for entry in later:
                heapq.heappush(heap, entry)

    def _fair(self, now: float, seen: set[Sequence], limit: int) -> Iterator[Sequence]:
        vtc = dict(self._vtc)  # this step's picks count, so one step does not go to one tenant
        step_adapters = {k for k, n in self._running_adapters.items() if n > 0}
        popped: dict[str, list[tuple[int, int, int, Sequence]]] = {}
        looked = 0
        try:
            while looked < limit:
                tenant = self._least_served(vtc)
                if tenant is None:
                    return
                oldest = next(iter(self._tenant_waiting[tenant]))
                if oldest not in seen and now - oldest.waiting_since >= self.max_wait:
                    # starved: first among its tenant's, past any hold (fairness still picks the tenant)
                    seen.add(oldest)
                    looked += 1
                    vtc[tenant] += oldest.num_uncomputed / self.weights.get(tenant, 1.0)
                    yield oldest
                    continue
                heap = self._by_tenant[tenant]
                entry = heapq.heappop(heap)
                seq = entry[3]
                if seq not in self._waiting:
                    continue  # stale
                popped.setdefault(tenant, []).append(entry)
                looked += 1
                if seq in seen:
                    continue
                key = adapter_key(seq)
                if key is not None and key not in step_adapters and self._hold(seq, key, now, step_adapters):
                    continue
                if key is not None:
                    step_adapters.add(key)
                vtc[tenant] += seq.num_uncomputed / self.weights.get(tenant, 1.0)
                yield seq
        finally:  # everything looked at goes back; admitted ones are stale entries from now on
            for tenant, entries in popped.items():
                heap = self._by_tenant[tenant]
                for entry in entries:
                    if entry[3] in self._waiting:
                        heapq.heappush(heap, entry)

    def _hold(self, seq: Sequence, key: str, now: float, step_adapters: set[str]) -> bool:
        """Whether a sequence that would bring a new adapter into the step waits instead."""
        if not step_adapters:
            return False  # an idle machine gains nothing by waiting (and would never wake up)
        if self._waiting_adapters[key] >= self.group:
            return False  # company is here: the group shares the segment it adds
        if now - self._last_ran.get(key, -1e18) < self.popular:
            return False  # it ran a moment ago: a popular adapter between requests, not a stray
        if self.top_share > 0 and self._decayed(key, now) > self._top_count(now):
            return False  # one of the most requested adapters
        return len(step_adapters) >= self.max_adapters or now - seq.waiting_since < self.window

    def _decayed(self, key: str, now: float) -> float:
        count, then = self._arrivals.get(key, (0.0, now))
        return count * math.exp((then - now) / _RATE_TAU_S)

    def _top_count(self, now: float) -> float:
        """The decayed arrival count an adapter must exceed to be among the top `top_share` of
        the adapters seen (at least one adapter), refreshed every _TOP_REFRESH_S; adapters whose
        count has decayed away are forgotten then."""
        if now - self._top_at >= _TOP_REFRESH_S:
            counts = {k: self._decayed(k, now) for k in self._arrivals}
            for k in [k for k, c in counts.items() if c < 1e-3 and not self._waiting_adapters[k]]:
                del self._arrivals[k], counts[k]
            ranked = sorted(counts.values(), reverse=True)
            top = max(1, math.ceil(self.top_share * len(ranked)))
            # above the first adapter outside the top share (ties with it are not top)
            self._top_floor = ranked[top] if top < len(ranked) else 0.0
            self._top_at = now
        return self._top_floor

    def _least_served(self, vtc: dict[str, float]) -> str | None:
        best: str | None = None
        for tenant, heap in self._by_tenant.items():
            while heap and heap[0][3] not in self._waiting:
                heapq.heappop(heap)  # drop stale heads, so an empty-looking tenant is skipped
            if heap and (best is None or vtc[tenant] < vtc[best]):
                best = tenant
        return best


class _View(SeqView[Sequence]):
    """The waiting sequences, oldest first; indexing walks from the front (callers look at a head)."""

    def __init__(self, waiting: dict[Sequence, None]) -> None:
        self._waiting = waiting

    def __len__(self) -> int:
        return len(self._waiting)

    def __iter__(self) -> Iterator[Sequence]:
        return iter(self._waiting)

    def __contains__(self, seq: object) -> bool:
        return seq in self._waiting

    def __getitem__(self, i: int | slice) -> Any:  # noqa: ANN401
        if isinstance(i, slice):
            return list(itertools.islice(self._waiting, i.start, i.stop, i.step))
        return next(itertools.islice(self._waiting, i, None))


def parse_weights(text: str) -> dict[str, float]:
    """'a:3,b:1' -> {'a': 3.0, 'b': 1.0}; tenants not named weigh 1."""
    out: dict[str, float] = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        name, _, weight = part.partition(":")
        out[name] = float(weight or 1.0)
        if out[name] <= 0:
            raise ValueError(f"tenant weight must be positive: {part!r}")
    return out


def make_policy(config: SchedulerConfig, clock: Callable[[], float]) -> FCFSPolicy | AdaptivePolicy:
    if config.policy == "fcfs":
        return FCFSPolicy()
    if config.policy == "adaptive":
        return AdaptivePolicy(config, clock)
    raise ValueError(f"unknown scheduler policy {config.policy!r}: fcfs or adaptive")
