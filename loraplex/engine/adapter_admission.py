"""The engine's adapter side: registration into the tiers, admission (a hold on the revision and
the start of its load), the scheduler's gate, each step's slot map, failed loads, retirement, and
the per-request residency measurements (stall time, time to first token by admission tier).

Everything here runs on the engine's thread; the tiers (`adapters/tiers.py`) own where weights
are, the registry (`adapters/registry.py`) who holds which revision.
"""

from __future__ import annotations

import operator
import sys
import time
from collections.abc import Callable, Iterable

from loraplex.adapters.base_identity import BaseIdentity
from loraplex.adapters.peft_import import ImportedAdapter
from loraplex.adapters.registry import AdapterRegistry, check_adapter_name
from loraplex.adapters.residency import StepSlots
from loraplex.adapters.revision import adapter_revision
from loraplex.adapters.tiers import AdapterTiers
from loraplex.engine.scheduler import ScheduledChunk, StepPlan
from loraplex.engine.sequence import Sequence
from loraplex.types import AdapterRef

# a scheduled chunk's adapter, in C (`map` over a step's chunks costs less than a comprehension)
_ADAPTER_OF_CHUNK = operator.attrgetter("seq.adapter")


class AdapterAdmission:
    def __init__(
        self, adapters: AdapterRegistry, tiers: AdapterTiers, base: Callable[[], BaseIdentity]
    ) -> None:
        self.adapters = adapters
        self.tiers = tiers
        self._base = base  # the served base's identity, hashed on first use
        # Called when the last request on a retired revision ends (the server records the
        # retirement; it must not block).
        self.on_drained: Callable[[AdapterRef], None] | None = None
        # Forgets the prefix cache's blocks of a revision that left service (None: no cache).
        self.drop_cached: Callable[[str], object] | None = None
        # Live adapter requests with no token yet: while there are none, a step measures nothing.
        self.awaiting_first = 0
        self.residency = tiers.residency
        self._last_slot_map: tuple[tuple[ScheduledChunk, ...], int, StepSlots] | None = None

    # --- the step's slots -------------------------------------------------------------------------

    def slot_map(self, plan: StepPlan) -> StepSlots:
        """The plan's slot map from residency; its slots stay pinned until `residency.end_step()`.
        The last step's map is reused when the plan has the same chunks (identical objects: a
        steady decode batch) and no slot changed since; comparing the chunk tuples is a C loop of
        identity checks, a fraction of a new map's cost (4 µs at 64 rows on a slow CPU)."""
        chunks, residency = plan.chunks, self.residency
        last = self._last_slot_map
        if last is not None and last[0] == chunks and last[1] == residency.version:
            residency.repin(last[2])
            return last[2]
        slots = residency.step_slots(map(_ADAPTER_OF_CHUNK, chunks))
        self._last_slot_map = (chunks, residency.version, slots)
        return slots

    # --- registration and retirement -------------------------------------------------------------

    def register(
        self, name: str, imported: ImportedAdapter, revision: str | None, tenant: str, visibility: str
    ) -> AdapterRef:
        """Load verified weights into the tiers, then name them (see `Engine.register_imported`)."""
        check_adapter_name(name)
        base = self._base().revision
        made_for = imported.manifest.get("base_revision")
        if made_for is not None and made_for != base:
            raise ValueError(
                f"base model mismatch: {name} was made for base revision {made_for!r}, this engine "
                f"serves {base!r}"
            )
        revision = revision or adapter_revision(imported)
        if self.adapters.is_retired(AdapterRef(name, revision)):  # before loading: nothing changes
            raise ValueError(f"{name}@{revision[:12]} is retired; a retired revision stays retired")
        weights = self.tiers.register(revision, imported.weights, tenant)
        warning = self.tiers.registration_warning(revision)
        if warning is not None:
            print(f"warning: {name}: {warning}", file=sys.stderr)
        return self.adapters.add(
            name, revision, weights.max_rank, weights.nbytes, imported.manifest, tenant, visibility
        )

    def retire(self, ref: AdapterRef) -> None:
        if self.adapters.retire(ref):
            self._drained(ref)

    def _drained(self, ref: AdapterRef) -> None:
        """No request holds the retired `ref` any more: free its slot and its cached KV blocks
        unless another name still serves the same content, and tell the server (which records the
        retirement)."""
        if not self.adapters.in_service(ref.revision):
            self.tiers.drop(ref.revision)
            if self.drop_cached is not None:  # no request may compute or read them any more
                self.drop_cached(ref.revision)
        if self.on_drained is not None:
            self.on_drained(ref)

    # --- requests --------------------------------------------------------------------------------

    def acquire(self, adapter: str | AdapterRef | None) -> tuple[AdapterRef | None, str | None]:
        """Hold the request's revision and start its load: (the revision, the tier it was in).
        Raises (holding nothing) for an unknown adapter or one that cannot load now."""
        ref = self.adapters.acquire(adapter)
        if ref is None:
            return None, None
        try:
            return ref, self.tiers.admit(ref.revision)
        except Exception:
            self.adapters.release(ref)
            raise

    def admitted(self, seq: Sequence, tier: str | None) -> None:
        """Start the request's clocks: time to first token, and its stall when not on the device."""
        if tier is None:
            return
        seq.admission_tier = tier
        seq.admitted_at = now = time.perf_counter()
        if tier != "device":
            seq.stalled_since = now
        self.awaiting_first += 1

    def ready(self, seq: Sequence) -> bool:
        """The scheduler's gate: a sequence runs once its adapter is device-resident (asking starts
        the load; meanwhile the sequences behind it are admitted)."""
        if seq.adapter is None:
            return True
        if not self.tiers.ready(seq.adapter.revision):
            return False
        if seq.stalled_since is not None:
            self._end_stall(seq)
        return True

    def first_tokens(self, seqs: Iterable[Sequence]) -> None:
        """Before a step's sampled tokens are appended: time to first token of those getting theirs."""
        now = time.perf_counter()
        ttft = self.tiers.metrics.ttft_seconds
        for seq in seqs:
            if seq.admission_tier is not None and not seq.output_token_ids:
                ttft[seq.admission_tier].observe(now - seq.admitted_at)
                self.awaiting_first -= 1
                self.tiers.events += 1

    def release(self, seq: Sequence) -> None:
        """A request ended (finished, failed or aborted): end its clocks and its hold; a retired
        revision whose last request this was is drained."""
        if seq.admission_tier is not None and not seq.output_token_ids:
            self.awaiting_first -= 1
        if seq.stalled_since is not None:
            self._end_stall(seq)
        if self.adapters.release(seq.adapter):
            assert seq.adapter is not None
            self._drained(seq.adapter)

    def _end_stall(self, seq: Sequence) -> None:
        assert seq.stalled_since is not None
        self.tiers.metrics.stall_seconds += time.perf_counter() - seq.stalled_since
        seq.stalled_since = None
        self.tiers.events += 1

    def check_integrity(self, live: list[Sequence]) -> None:
        """Assert that each revision's holds equal the live requests on it, and that the requests
        awaiting a first token are counted right."""
        holds: dict[AdapterRef, int] = {}
        for seq in live:
            if seq.adapter is not None:
                holds[seq.adapter] = holds.get(seq.adapter, 0) + 1
        for entry in self.adapters.list():
            assert self.adapters.holds(entry.ref) == holds.get(entry.ref, 0), f"hold count of {entry.ref}"
        awaiting = sum(s.admission_tier is not None and not s.output_token_ids for s in live)
        assert self.awaiting_first == awaiting, "requests awaiting a first token"

    # --- between steps ---------------------------------------------------------------------------

    def failed_loads(self, waiting: Iterable[Sequence]) -> list[Sequence]:
        """Place finished loads; the waiting sequences whose adapter could not be loaded (the store
        lost it, or it outgrows the device budget), for the engine to abort."""
        tiers = self.tiers
        tiers.poll()
        failures = tiers.take_failures()
        if not failures:
            return []
        for revision, why in failures.items():
            print(f"adapter revision {revision[:12]} failed to load: {why}", file=sys.stderr)
        doomed = [s for s in waiting if s.adapter and s.adapter.revision in failures]
        for seq in doomed:
            ref = seq.adapter
            assert ref is not None
            seq.error = f"adapter {ref.name}@{ref.revision[:12]} was not loaded: {failures[ref.revision]}"
        return doomed
