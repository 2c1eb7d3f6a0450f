"""Tiered residency: store (disk) -> host cache -> device pool, loads on demand, eviction by policy.

The engine asks `ready(revision)` before it schedules a waiting sequence: a device-resident
revision is ready; any other starts loading (once) and is not, so the sequence waits while every
other request keeps running. `poll()`, at the start of each step and on the step thread, turns
finished loads into device residency:

- From the host tier the weights are at hand; from the store (the disk tier, read through the
  `source` callback its owner installs, e.g. the server's control service) a single background
  thread reads and converts them, so a slow read never holds up a step.
- Placing a load that does not fit evicts victims the eviction policy picks among the
  device-resident revisions (adapters/tier_room.py says which are protected, and when); victims
  go to the host tier first, so they reload without disk. An adapter that became resident in
  this `poll` is never a victim: the step planned next sees every load it finished. Otherwise,
  with nothing running, two loads could evict each other as each completes, and a starved
  request at the front of the adaptive order would never see its adapter.
- Each tenant's residency limits (set at runtime by `set_tenant_limits`, from the control plane's
  records) feed the policy: device budgets, guaranteed residency, priority, and a cold-load rate
  paid when a load onto the device starts. A load over its tenant's rate is deferred (its requests
  wait, passed over by the scheduler like any loading adapter), or, when the tenant's limits say
  `refuse`, its request is refused at admission (`ColdLoadLimited`, with the wait).
- Loads happen between steps only (no slot is pinned then), so no step ever sees a slot change
  under it; the slot generations catch any per-step data built before a change.
- On CUDA the host -> device copy itself is asynchronous (`copies`, adapters/h2d_copy.py): a
  placement reserves the room and queues the copy on a side stream; a later `poll` commits it
  once its event has completed. On the CPU the copy is synchronous, between steps.

Nothing here scales with the number of registered adapters on the step path: `poll` returns at
once when no load is in flight, and a placement looks at resident adapters and the live queue.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Mapping
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import replace

from loraplex.adapters.device_pool import AdapterPool, PoolFullError
from loraplex.adapters.eviction import EvictionPolicy, TenantLimits
from loraplex.adapters.h2d_copy import AsyncLoads
from loraplex.adapters.host_cache import HostCache
from loraplex.adapters.residency import AdapterResidency, Residency
from loraplex.adapters.tenant_residency import effective
from loraplex.adapters.tier_metrics import TierMetrics
from loraplex.adapters.tier_room import Demand, victims_for
from loraplex.lora.weights import AdapterWeights

Source = Callable[[str], AdapterWeights]


class AdapterLoadError(RuntimeError):
    """An adapter revision cannot be made resident (the message says why)."""


class ColdLoadLimited(AdapterLoadError):
    """Refused at admission: the adapter's tenant is over its cold-load rate and its limits say
    `refuse`; `retry_after_s` is when the load would be admitted."""

    def __init__(self, message: str, retry_after_s: float) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class AdapterTooLarge(AdapterLoadError):
    """Refused at admission: the revision needs more device bytes than the whole device budget, so
    no eviction can ever make room for it."""


class AdapterTiers:
    def __init__(
        self,
        residency: AdapterResidency,
        pool: AdapterPool,
        host: HostCache,
        demand: Demand,
        policy: EvictionPolicy | None = None,
        clock: Callable[[], float] = time.monotonic,
        copies: AsyncLoads | None = None,
    ) -> None:
        self.residency = residency
        self.pool = pool
        self.host = host
        self.policy = policy or EvictionPolicy()
        self.demand = demand
        # (a starved request's revision, the revision drained to make room for it): the drained
        # one's slot is that load's alone (engine/slot_drain.py); (None, None) when none is
        self.reserved: Callable[[], tuple[str | None, str | None]] = lambda: (None, None)
        self.clock = clock
        self.copies = copies  # CUDA: side-stream copies in flight; None: placements copy at once
        # The disk tier: reads a revision's weights (any dtype, any device). None: adapters live
        # only where they were registered, so the host tier keeps every one of them.
        self.source: Source | None = None
        self._tenant: dict[str, str] = {}
        self._loading: dict[str, Future[AdapterWeights]] = {}  # background reads from the source
        self._ready: dict[str, AdapterWeights] = {}  # host copies waiting for device room
        self._failed: dict[str, str] = {}  # revision -> why its last load failed
        self._sizes: dict[str, int] = {}  # revision -> device footprint (what a cold load pays)
        self._deferred: set[str] = set()  # loads waiting for their tenant's cold-load rate
        self._started: dict[str, tuple[str, float]] = {}  # revision -> (source tier, load start)
        self._copying: dict[str, AdapterWeights] = {}  # side-stream copies in flight: their host copy
        self._placed: set[str] = set()  # resident since this `poll` began: no victims before a step
        self.metrics = TierMetrics()
        self._executor: ThreadPoolExecutor | None = None
        self.counts: Counter[str] = Counter()  # hits per tier, loads, evictions, stalls
        self.events = 0  # bumped on every change to what `stats` reports: metrics refresh on change

    # --- registration ----------------------------------------------------------------------------

    def register(self, revision: str, weights: AdapterWeights, tenant: str) -> AdapterWeights:
        """Take a registered revision's weights into the host tier (kept there when no store backs
        it) and onto the device when that needs no eviction. Returns the host copy."""
        self._tenant[revision] = tenant
        self._failed.pop(revision, None)
        copy = self.host.put(revision, weights, keep=self.source is None)
        self._sizes[revision] = self.pool.footprint(copy)
        self.events += 1
        if not self._in_flight(revision) and self.pool.free_bytes >= self._sizes[revision]:
            try:
                self.residency.load(revision, copy)
                self.metrics.host_to_device_bytes += copy.nbytes
            except PoolFullError:  # free bytes split by adapters that may not move: loaded on demand
                pass
        return copy

    def drop(self, revision: str) -> None:
        """A retired revision nobody holds: free its device room and host copy, forget it."""
        if self.copies is not None:
            self.copies.cancel(revision)
            self._copying.pop(revision, None)
        self.residency.evict(revision)
        self.host.drop(revision)
        self.events += 1
        self._ready.pop(revision, None)
        self._tenant.pop(revision, None)
        self._sizes.pop(revision, None)
        self._deferred.discard(revision)
        self._started.pop(revision, None)
        self.policy.forget(revision)

    # --- tenants ---------------------------------------------------------------------------------

    def set_tenant_limits(self, limits: Mapping[str, TenantLimits]) -> None:
        """Every tenant's residency limits (tenants not named get the defaults), effective for the
        next placement and the next cold load: on the engine thread, between steps."""
        self.policy.config = replace(self.policy.config, tenants=dict(limits))
        self.events += 1

    def tenants(self) -> dict[str, dict[str, object]]:
        """Per tenant with limits or device-resident adapters: its limits (defaults filled in) and
        what it holds on the device now."""
        held: dict[str, list[int]] = {}
        for r in self.residency.resident_revisions():
            counts = held.setdefault(self._tenant.get(r, ""), [0, 0])
            counts[0] += 1
            counts[1] += self.pool.allocated_of(r)
        config = self.policy.config
        return {
            t: {
                "limits": effective(config.limits(t)),
                "device_adapters": held.get(t, [0, 0])[0],
                "device_bytes": held.get(t, [0, 0])[1],
            }
            for t in sorted({*config.tenants, *held})
        }

    # --- admission -------------------------------------------------------------------------------

    def admit(self, revision: str) -> str:
        """A request for `revision` was admitted: count the tier it was found in (device, host or
        disk), record the use, and start its load. Raises AdapterLoadError when it can never load."""
        why = self.too_large(revision)
        if why is not None:
            raise AdapterTooLarge(why)
        self.policy.touch(revision, self.clock())
        if self.residency.state(revision) is Residency.RESIDENT:
            tier = "device"
        elif revision in self.host or revision in self._ready:
            tier = "host"
        else:
            tier = "disk"
            if self.source is None:
                raise AdapterLoadError(
                    f"revision {revision[:12]} is not resident and there is no store to load it from"
                )
        if tier != "device":
            self._refuse_over_rate(revision)
        self.counts[f"{tier}_hits"] += 1
        self.events += 1
        if tier != "device":
            self.counts["stalled"] += 1
            self._start(revision)
        return tier

    def too_large(self, revision: str) -> str | None:
        """Why `revision` can never be on the device (more bytes than the whole device budget), or
        None."""
        size = self._sizes.get(revision, 0)
        return None if size <= self.pool.budget_bytes else self._over_budget(revision, size)

    def registration_warning(self, revision: str) -> str | None:
        """What registering `revision` should warn about (kept, since a larger budget can serve it,
        but refused here), or None: said on stderr and in the admin API's reply alike."""
        why = self.too_large(revision)
        return None if why is None else f"{why}; requests for it are refused"

    def _over_budget(self, revision: str, size: int) -> str:
        return (
            f"adapter revision {revision[:12]} needs {size} bytes of adapter device memory, more than "
            f"the whole adapter device budget of {self.pool.budget_bytes} bytes "
            f"(--adapter-device-bytes)"
        )

    def ready(self, revision: str) -> bool:
        """Whether a sequence on `revision` may run now; if not, its load is under way."""
        if self.residency.is_resident(revision):
            return True
        if revision not in self._failed:  # a failed load waits for the engine to fail its requests
            self._start(revision)
        return False

    def _in_flight(self, revision: str) -> bool:
        return revision in self._loading or (self.copies is not None and revision in self.copies)

    def _refuse_over_rate(self, revision: str) -> None:
        """Raise ColdLoadLimited if `revision` needs a cold load its tenant's rate does not allow
        now and its tenant's limits say to refuse rather than wait."""
        if revision in self._ready or self._in_flight(revision):
            return  # under way already: nothing more to pay
        tenant = self._tenant.get(revision, "")
        limits = self.policy.config.limits(tenant)
        if limits.cold_load_over_rate != "refuse":
            return
        size = self._sizes.get(revision, 0)
        wait_s = self.policy.cold_load_wait(tenant, size, self.clock())
        if wait_s > 0:
            self.counts["cold_load_refusals"] += 1
            self.events += 1
            raise ColdLoadLimited(
                f"tenant {tenant!r} is over its cold-load rate of {limits.cold_load_bytes_per_minute} "
                f"bytes per minute: adapter revision {revision[:12]} ({size} bytes) could start "
                f"loading in {wait_s:.1f} s",
                wait_s,
            )

    def _start(self, revision: str) -> None:
        if revision in self._ready or self._in_flight(revision):
            return
        tenant = self._tenant.get(revision, "")
        if not self.policy.admit_cold_load(tenant, self._sizes.get(revision, 0), self.clock()):
            if revision not in self._deferred:
                self._deferred.add(revision)
                self.counts["cold_load_waits"] += 1
                self.events += 1
            return
        self._deferred.discard(revision)
        weights = self.host.get(revision)
        if weights is not None:
            self._started[revision] = ("host", self.clock())
            self._ready[revision] = weights
            return
        if self.source is None:
            self._failed[revision] = "no store to load it from"
            return
        if self._executor is None:
            self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="adapter-load")
        source = self.source
        self._started[revision] = ("disk", self.clock())
        self._loading[revision] = self._executor.submit(lambda: self.host.host_copy(source(revision)))

    # --- between steps ---------------------------------------------------------------------------

    @property
    def busy(self) -> bool:
        """Loads in flight (reading or copying), waiting for room or for their tenant's cold-load
        rate, or failures the engine has yet to report."""
        return bool(self._loading or self._ready or self._failed or self._deferred or self.copies)

    def poll(self) -> None:
        """Place every finished load that has room (evicting by policy); on the step thread."""
        # Deferred loads are asked for again by the scheduler's gate after this; one nobody asks
        # for any more (its requests ended) is forgotten.
        self._deferred.clear()
        self._placed.clear()
        if self.copies:
            for revision in self.copies.finished():  # side-stream copies complete: now resident
                self.counts["loads"] += 1
                self.events += 1
                self._record_load(revision, self._copying.pop(revision))
                self._placed.add(revision)
        if not (self._loading or self._ready):
            return
        for revision, future in list(self._loading.items()):
            if not future.done():
                continue
            del self._loading[revision]
            try:
                weights = future.result()
            except Exception as err:  # the store's message names the file and the problem
                self._failed[revision] = str(err)
                self.counts["load_failures"] += 1
                self.events += 1
                continue
            self.counts["disk_loads"] += 1
            # Fetched weights enter the host tier (unkept: the store has them), so the next eviction
            # of this revision costs no disk read.
            self._ready[revision] = self.host.put(revision, weights)
        starved = self.reserved()[0]
        for revision in sorted(self._ready, key=lambda r: r != starved):  # its load first
            if self._place(revision, self._ready[revision]):
                del self._ready[revision]

    def wait(self, timeout: float) -> None:
        """Block up to `timeout` seconds for a background load to finish: a step with nothing to run
        but loads in flight waits here instead of spinning against the loader thread."""
        if self._loading:
            wait(list(self._loading.values()), timeout=timeout, return_when=FIRST_COMPLETED)
        elif self.copies:
            self.copies.wait(timeout)
        elif self._deferred:  # only cold-load rates to wait for: no load can finish sooner
            time.sleep(timeout)

    def take_failures(self) -> dict[str, str]:
        """Revisions whose load failed since the last call, with why (cleared, so a later request
        tries again)."""
        failed, self._failed = self._failed, {}
        for revision in failed:
            self._started.pop(revision, None)
        return failed

    def _place(self, revision: str, weights: AdapterWeights) -> bool:
        if self.residency.state(revision) is Residency.RESIDENT:
            return True
        size = self.pool.footprint(weights)
        if size > self.pool.budget_bytes:  # (admission refuses these; a guard, not a path)
            self._failed[revision] = self._over_budget(revision, size)
            return True
        if size > self.pool.free_bytes and not self._make_room(revision, size):
            return False
        # Enough free bytes can still be split by adapters that may not move now (their own loads
        # still copying on the side stream, or pinned by a step): then evict one more at a time, by
        # policy, until a run of free bytes is long enough; else the load waits for a later poll.
        while not self._start_placement(revision, weights):
            free = self.pool.free_bytes
            if not self._make_room(revision, free + 1) or self.pool.free_bytes <= free:
                return False
        if self.copies is not None:  # resident once the copy completes (counted in `poll`)
            return True
        self._placed.add(revision)
        self.counts["loads"] += 1
        self.events += 1
        self._record_load(revision, weights)
        return True

    def _start_placement(self, revision: str, weights: AdapterWeights) -> bool:
        """Place `revision` in the pool: queue its copy (CUDA) or copy it now. False, with nothing
        changed, when the free bytes are not contiguous even after compaction."""
        try:
            if self.copies is not None:
                self.copies.start(revision, weights)
                self._copying[revision] = weights
            else:
                self.residency.load(revision, weights)
        except PoolFullError:
            return False
        return True

    def _record_load(self, revision: str, weights: AdapterWeights) -> None:
        """Count a finished load onto the device: its bytes, and its latency from the start of the
        load to the placement (including any wait for room), by the tier it came from."""
        self.metrics.host_to_device_bytes += weights.nbytes
        started = self._started.pop(revision, None)
        if started is not None:
            self.metrics.load_seconds[started[0]].observe(self.clock() - started[1])

    def _make_room(self, revision: str, size: int) -> bool:
        victims = victims_for(
            revision,
            size,
            self.demand,
            self.reserved(),
            self._tenant,
            self._placed,
            self.pool,
            self.host,
            self.residency,
            self.policy,
            self.clock(),
        )
        if victims is None:
            return False
        for victim in victims:
            if victim not in self.host:  # keep it one cheap copy away (the host tier may drop it)
                self.host.put(victim, self.residency.weights(victim))
            self.residency.evict(victim)
            self.counts["evictions"] += 1
            self.events += 1
        return True

    # --- visibility ------------------------------------------------------------------------------

    def stats(self) -> dict[str, object]:
        device = self.pool.stats()
        return {
            "device": {**device, "hits": self.counts["device_hits"]},
            "host": self.host.stats(),
            "host_admissions": self.counts["host_hits"],
            "disk": {"hits": self.counts["disk_hits"], "loads": self.counts["disk_loads"]},
            "loads": self.counts["loads"],
            "evictions": self.counts["evictions"],
            "load_failures": self.counts["load_failures"],
            "stalled_requests": self.counts["stalled"],
            "loading": len(self._loading) + len(self._ready) + len(self.copies or ()),
            "cold_load_waits": self.counts["cold_load_waits"],
            "cold_load_refusals": self.counts["cold_load_refusals"],
            **self.metrics.snapshot(),
        }

    def where(self) -> dict[str, list[str]]:
        """Which revisions are in which tier now (a revision may be in both), and which are loading."""
        return {
            "device": sorted(self.residency.resident_revisions()),
            "host": sorted(self.host.revisions()),
            "loading": sorted(
                {*self._loading, *self._ready, *(self.copies.revisions() if self.copies else ())}
            ),
            "waiting_for_cold_load_rate": sorted(self._deferred),
        }

    def close(self) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=False, cancel_futures=True)
