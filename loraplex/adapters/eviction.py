"""Which device-resident adapters to evict for a load: a small pure policy over ids and integers.

No torch and no clock of its own: the caller passes `now` (seconds from any monotonic clock) and
describes every resident adapter as a `Candidate`. The rules, in order:

1. **Never** an adapter with active references (sequences running on it, steps pinning it), and
   never one that queued requests wait for: evicting it would only make them load it again.
   (Which waiting requests count is the caller's, i.e. the scheduler's, choice; starvation of a
   cold adapter behind hot ones is the scheduler's to prevent.)
2. **Tenant budgets**: a tenant whose adapters would exceed its device budget with the incoming
   one must first make room among its own adapters.
3. **Guaranteed residency**: another tenant's adapters are taken only down to that tenant's
   guaranteed bytes and guaranteed adapter count, so a tenant cycling through many cold adapters
   churns its own share and the unguaranteed rest, never someone else's guarantee. A tenant may
   replace its own adapters.
4. **Cost, not just recency**: among the evictable, the lowest *keep value* goes first:
   `priority x (heat + floor) x reload cost / bytes`, where heat is an exponentially decayed use
   count (recency and frequency in one number: each `touch` adds 1, halving every
   `frequency_half_life` seconds) and the reload cost is the bytes to read back weighted by the
   tier they come back from (host memory is cheap, disk dear). Per byte freed, a cold, rarely used
   adapter that reloads from host memory is the cheapest loss. Ties go to the least recently used,
   then to the smaller id, so the choice is deterministic.
5. Victims no longer needed once later (larger) ones were chosen are put back.

Separately, `admit_cold_load` enforces each tenant's cold-load bytes per minute with a token
bucket, so one tenant cannot turn the device pool over faster than its limit allows.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from enum import Enum

_HEAT_FLOOR = 0.01  # keeps cost and priority meaningful for adapters never used (heat 0)


class Tier(Enum):
    """Where an evicted adapter's weights come back from."""

    HOST = "host"
    DISK = "disk"


class InvalidLimit(ValueError):
    """A tenant limit out of range; `field` names it (the admin API reports it as the `param`)."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


COLD_LOAD_OVER_RATE = ("wait", "refuse")  # what a request over its tenant's cold-load rate gets
_NON_NEGATIVE = (
    "guaranteed_bytes",
    "guaranteed_adapters",
    "device_budget_bytes",
    "cold_load_bytes_per_minute",
)  # what a request over its tenant's cold-load rate gets


@dataclass(frozen=True)
class TenantLimits:
    priority: float = 1.0  # multiplies the keep value of the tenant's adapters
    guaranteed_bytes: int = 0  # device bytes other tenants' loads cannot take from it
    guaranteed_adapters: int = 0  # resident adapters other tenants' loads cannot take from it
    device_budget_bytes: int | None = None  # most device bytes its adapters may hold; None: no limit
    cold_load_bytes_per_minute: int | None = None  # None: no limit
    cold_load_burst_bytes: int | None = None  # the bucket's size; None: one minute's worth
    # Over the rate, a request waits for its load (others keep running), or is refused at once.
    cold_load_over_rate: str = "wait"

    def __post_init__(self) -> None:
        if not self.priority > 0:
            raise InvalidLimit("priority", f"tenant priority must be > 0, got {self.priority}")
        for name in (
            "guaranteed_bytes",
            "guaranteed_adapters",
            "device_budget_bytes",
            "cold_load_bytes_per_minute",
        ):
            value = getattr(self, name)
            if value is not None and value < 0:
                raise InvalidLimit(name, f"{name} must be >= 0, got {value}")
        budget = self.device_budget_bytes
        if budget is not None and self.guaranteed_bytes > budget:
            raise InvalidLimit(
                "guaranteed_bytes",
                f"guaranteed_bytes {self.guaranteed_bytes} exceed the device budget of {budget} bytes",
            )
        if self.cold_load_burst_bytes is not None and self.cold_load_burst_bytes <= 0:
            raise InvalidLimit(
                "cold_load_burst_bytes",
                f"cold_load_burst_bytes must be > 0, got {self.cold_load_burst_bytes}",
            )
        if self.cold_load_over_rate not in COLD_LOAD_OVER_RATE:
            raise InvalidLimit(
                "cold_load_over_rate",
                f"cold_load_over_rate must be one of {COLD_LOAD_OVER_RATE}, got {self.cold_load_over_rate!r}",
            )


@dataclass(frozen=True)
class EvictionConfig:
    # relative cost of reading one byte back from each tier
    reload_cost_per_byte: Mapping[Tier, float] = field(
        default_factory=lambda: {Tier.HOST: 1.0, Tier.DISK: 10.0}
    )
    frequency_half_life: float = 60.0  # seconds
    tenants: Mapping[str, TenantLimits] = field(default_factory=dict)
    default_tenant: TenantLimits = TenantLimits()  # for tenants not named in `tenants`

    def __post_init__(self) -> None:
        if not self.frequency_half_life > 0:
            raise ValueError(f"frequency_half_life must be > 0 seconds, got {self.frequency_half_life}")
        for tier in Tier:
            cost = self.reload_cost_per_byte.get(tier)
            if cost is None or cost < 0:
                raise ValueError(
                    f"reload_cost_per_byte needs a cost >= 0 for the {tier.value} tier, got {cost}"
                )

    def limits(self, tenant: str) -> TenantLimits:
        return self.tenants.get(tenant, self.default_tenant)


@dataclass(frozen=True)
class Candidate:
    """One device-resident adapter, as the caller sees it now."""

    id: str
    tenant: str
    nbytes: int  # device bytes its eviction frees
    reload_tier: Tier  # where it would come back from
    reload_bytes: int | None = None  # bytes read back on reload; None: nbytes
    references: int = 0  # running sequences and step pins: never evicted while > 0
    queued: int = 0  # queued requests waiting for it: protected


@dataclass(frozen=True)
class VictimChoice:
    """The adapters to evict, in eviction order, or why no choice makes the room (`refusal`)."""

    victims: tuple[str, ...] = ()
    freed_bytes: int = 0
    refusal: str | None = None

    @property
    def ok(self) -> bool:
        return self.refusal is None


@dataclass
class _Use:
    heat: float  # decayed use count at `last`
    last: float


@dataclass
class _Bucket:
    tokens: float
    last: float


class EvictionPolicy:
    def __init__(self, config: EvictionConfig | None = None) -> None:
        self.config = config or EvictionConfig()
        self._use: dict[str, _Use] = {}
        self._buckets: dict[str, _Bucket] = {}

    # --- use ------------------------------------------------------------------------------------

    def touch(self, adapter: str, now: float) -> None:
        """Record one use of `adapter` (a request admitted for it, or a step running it)."""
        self._use[adapter] = _Use(self.heat(adapter, now) + 1.0, now)

    def forget(self, adapter: str) -> None:
        """Drop what is known about `adapter` (retired: it will not be asked about again)."""
        self._use.pop(adapter, None)

    def heat(self, adapter: str, now: float) -> float:
        use = self._use.get(adapter)
        if use is None:
            return 0.0
        return use.heat * math.exp2(-max(0.0, now - use.last) / self.config.frequency_half_life)

    def keep_value(self, c: Candidate, now: float) -> float:
        """What keeping `c` is worth per device byte: evict the lowest first."""
        reload_bytes = c.nbytes if c.reload_bytes is None else c.reload_bytes
        cost = reload_bytes * self.config.reload_cost_per_byte[c.reload_tier]
        priority = self.config.limits(c.tenant).priority
        return priority * (self.heat(c.id, now) + _HEAT_FLOOR) * cost / max(c.nbytes, 1)

    def _order(self, candidates: list[Candidate], now: float) -> list[Candidate]:
        last = {c.id: (u.last if (u := self._use.get(c.id)) else -math.inf) for c in candidates}
        return sorted(candidates, key=lambda c: (self.keep_value(c, now), last[c.id], c.id))

    # --- choosing victims -----------------------------------------------------------------------

    def choose_victims(
        self,
        incoming_bytes: int,
        free_bytes: int,
        candidates: Iterable[Candidate],
        requester_tenant: str,
        now: float,
    ) -> VictimChoice:
        """Victims that make room for an adapter of `incoming_bytes` for `requester_tenant`, given
        the pool's `free_bytes` and every resident adapter (protected ones too: they count toward
        their tenant's bytes). A refusal names the rule that blocks the load."""
        resident = list(candidates)
        need = max(0, incoming_bytes - free_bytes)
        limits = self.config.limits(requester_tenant)
        held = _bytes_by_tenant(resident)
        own_need = 0
        if limits.device_budget_bytes is not None:
            if incoming_bytes > limits.device_budget_bytes:
                return VictimChoice(
                    refusal=f"tenant {requester_tenant!r}: the adapter needs {incoming_bytes} bytes, over "
                    f"its device budget of {limits.device_budget_bytes} bytes"
                )
            own_need = max(0, held.get(requester_tenant, 0) + incoming_bytes - limits.device_budget_bytes)
        if need == 0 and own_need == 0:
            return VictimChoice()

        evictable = [c for c in resident if c.references == 0 and c.queued == 0]
        ordered = self._order(evictable, now)
        chosen: list[Candidate] = []
        freed = 0
        for c in ordered:  # the tenant's budget first, from its own adapters
            if freed >= own_need:
                break
            if c.tenant == requester_tenant:
                chosen.append(c)
                freed += c.nbytes
        if freed < own_need:
            return VictimChoice(
                refusal=f"tenant {requester_tenant!r} holds {held.get(requester_tenant, 0)} device bytes of "
                f"its budget {limits.device_budget_bytes}; loading {incoming_bytes} more needs {own_need} of "
                f"its own freed, and only {freed} are evictable (the rest serve or await requests)"
            )

        taken = {c.id for c in chosen}
        counts = Counter(c.tenant for c in resident)
        removed: dict[str, int] = {}
        removed_count: Counter[str] = Counter()
        for c in ordered:  # then the pool's need, from anyone, above other tenants' guarantees
            if freed >= need:
                break
            if c.id in taken:
                continue
            if c.tenant != requester_tenant:
                theirs = self.config.limits(c.tenant)
                if held[c.tenant] - removed.get(c.tenant, 0) - c.nbytes < theirs.guaranteed_bytes:
                    continue
                if counts[c.tenant] - removed_count[c.tenant] - 1 < theirs.guaranteed_adapters:
                    continue
                removed[c.tenant] = removed.get(c.tenant, 0) + c.nbytes
                removed_count[c.tenant] += 1
            chosen.append(c)
            freed += c.nbytes
        if freed < need:
            return VictimChoice(refusal=self._no_room(need, freed, resident, evictable, requester_tenant))
        chosen = self._trim(chosen, need, own_need, requester_tenant, now)
        return VictimChoice(tuple(c.id for c in chosen), sum(c.nbytes for c in chosen))

    def _trim(
        self, chosen: list[Candidate], need: int, own_need: int, tenant: str, now: float
    ) -> list[Candidate]:
        """Put back victims the others already cover, most valuable first."""
        kept = list(chosen)
        for c in reversed(self._order(chosen, now)):
            rest = [v for v in kept if v is not c]
            own = sum(v.nbytes for v in rest if v.tenant == tenant)
            if sum(v.nbytes for v in rest) >= need and own >= own_need:
                kept = rest
        return kept

    def _no_room(
        self, need: int, freed: int, resident: list[Candidate], evictable: list[Candidate], tenant: str
    ) -> str:
        referenced = sum(c.nbytes for c in resident if c.references > 0)
        queued = sum(c.nbytes for c in resident if c.references == 0 and c.queued > 0)
        guarded = sum(c.nbytes for c in evictable) - freed
        return (
            f"tenant {tenant!r} needs {need} device bytes freed and at most {freed} can be: {referenced} "
            f"bytes serve running requests, {queued} bytes await queued requests, {guarded} bytes are "
            f"other tenants' guaranteed residency"
        )

    # --- cold-load rate ---------------------------------------------------------------------------

    def admit_cold_load(self, tenant: str, nbytes: int, now: float) -> bool:
        """Whether `tenant` may start a cold load of `nbytes` now; if so its bucket pays for it. A
        load larger than the bucket is admitted when the bucket is full (and leaves it in debt), so
        a large adapter is slowed, never locked out."""
        rate, size = self._rate(tenant)
        if rate is None:
            return True
        bucket = self._refill(tenant, rate, size, now)
        if bucket.tokens < min(nbytes, size):
            return False
        bucket.tokens -= nbytes
        return True

    def cold_load_wait(self, tenant: str, nbytes: int, now: float) -> float:
        """Seconds until `admit_cold_load(tenant, nbytes, ...)` would admit (0: now)."""
        rate, size = self._rate(tenant)
        if rate is None:
            return 0.0
        if rate == 0:
            return math.inf
        short = min(nbytes, size) - self._refill(tenant, rate, size, now).tokens
        return max(0.0, short / rate)

    def _rate(self, tenant: str) -> tuple[float | None, float]:
        limits = self.config.limits(tenant)
        per_minute = limits.cold_load_bytes_per_minute
        if per_minute is None:
            return None, math.inf
        size = limits.cold_load_burst_bytes if limits.cold_load_burst_bytes is not None else per_minute
        return per_minute / 60.0, float(size)

    def _refill(self, tenant: str, rate: float, size: float, now: float) -> _Bucket:
        bucket = self._buckets.get(tenant)
        if bucket is None:
            bucket = self._buckets[tenant] = _Bucket(size, now)
        bucket.tokens = min(size, bucket.tokens + max(0.0, now - bucket.last) * rate)
        bucket.last = max(bucket.last, now)  # a clock that steps back refills nothing
        return bucket


def _bytes_by_tenant(resident: Iterable[Candidate]) -> dict[str, int]:
    held: dict[str, int] = {}
    for c in resident:
        held[c.tenant] = held.get(c.tenant, 0) + c.nbytes
    return held
