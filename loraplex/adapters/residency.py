"""Where each adapter revision's weights are: revision -> device slot, and nothing else.

The only code that writes weights into the LoRA slot table or frees a slot. Identity (names,
revisions, request holds) is the registry's; this module knows revisions only.

- A revision is *resident* (its weights sit in a slot) or *pending* (known, not loaded). Loading
  on demand, the host tier and the choice of victims are `tiers.py`'s; this module only places
  and frees.
- With an `AdapterPool` (the device tier), `load` copies the weights into the pool and the slot
  table holds the pool's weights (the extent as one span with its layout; lora/packed.py). When
  a placement compacts the pool, the moved adapters' table entries are re-pointed at their new
  place under the same slot ids (the table's version bump
  makes the device tables refresh in place, so captured decode graphs stay valid) and their
  generations bump. Without a pool each adapter is its own allocation (tests of this module).
- On CUDA a load is two-phase (`reserve`, then `commit` once the side-stream copy into the
  reserved room has completed, see h2d_copy.py): in between the revision is not resident, so no
  step plan can name it. Its slot and slot-table entry may be claimed in between
  (`claim_slot`), so the kernels' pointer tables are updated while the copy runs.
- A registry **hold** lasts from a request's admission to its finish. A slot **pin** lasts one
  step: `step_slots` pins the slots of the sequences scheduled in the step and `end_step`
  unpins them. Only a pinned slot is protected here, so queued requests cost no slot; the caller
  must not evict a revision some live request holds (eviction with reload is a later layer).
- Freed slots are reused. Each slot carries a generation, bumped whenever its content changes,
  and each step's `StepSlots` records the generations it was built with, so per-step data that
  names a stale slot is detected (`check`) instead of silently reading another adapter.
- Per-slot facts (ranks per (layer, target), groups covered, bytes) are computed once, at load.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from enum import Enum
from typing import NamedTuple

import torch

from loraplex.adapters.device_pool import AdapterPool
from loraplex.lora.metadata import BASE_SLOT
from loraplex.lora.weights import AdapterWeights, LoRASlotTable
from loraplex.types import AdapterRef

_NONE: frozenset[int] = frozenset()


class Residency(Enum):
    PENDING = "pending"
    RESIDENT = "resident"


@dataclass(frozen=True)
class SlotFacts:
    slot: int
    generation: int
    ranks: dict[tuple[int, str], int]  # (layer, target) -> rank
    groups: frozenset[tuple[int, str]]  # (layer, group) pairs with at least one adapted slice
    max_rank: int
    nbytes: int


class StepSlots(NamedTuple):
    """One step's slot map: the slot of each chunk of the plan (BASE_SLOT for base rows). (A
    NamedTuple: one is built every step, at half the cost of a frozen dataclass.)"""

    slots: list[int]
    generations: dict[int, int]  # adapter slot -> its generation when the map was built


class SlotInUseError(RuntimeError):
    """An eviction asked for a slot that the running step has pinned (an engine bug)."""


class StaleSlotError(RuntimeError):
    """Per-step data names a slot whose content changed after the data was built."""


class AdapterResidency:
    def __init__(
        self,
        table: LoRASlotTable,
        dtype: torch.dtype,
        device: torch.device | str,
        pool: AdapterPool | None = None,
    ) -> None:
        self.table = table
        self.pool = pool
        self.dtype = dtype
        self.device = device
        self._slot_of: dict[str, int] = {}  # revision -> slot, resident revisions only
        self._facts: dict[int, SlotFacts] = {}  # slot -> facts of its current content
        self._generation: dict[int, int] = {}  # slot -> generation, kept after a slot is freed
        self._free: list[int] = []  # freed slots, reused lowest first
        self._claimed: dict[str, int] = {}  # reserved revision -> its slot, before `commit`
        self._next_slot = 0
        self._pinned: frozenset[int] = frozenset()
        # bumped whenever a revision's slot changes (load, evict): a slot map built at the same
        # version maps the same adapters to the same slots and generations
        self.version = 0

    # --- loading and freeing --------------------------------------------------------------------

    def load(self, revision: str, weights: AdapterWeights) -> SlotFacts:
        """Make `revision` resident (a no-op when it is). Identical content registered under two
        names is one revision, so it takes one slot."""
        slot = self._slot_of.get(revision)
        if slot is not None:
            return self._facts[slot]
        if self.pool is None:
            # before any bookkeeping: a failure changes nothing
            on_device = weights.to(self.device, self.dtype)
        else:
            on_device = self._place(revision, weights, copy=True)
        return self._install(revision, on_device)

    def reserve(self, revision: str, weights: AdapterWeights) -> AdapterWeights:
        """Room in the pool for `revision` without copying: returns the room as a span (weights
        with `packed` and no pairs; `pool.weights(revision)` is the adapter there), which an
        asynchronous copy fills (adapters/h2d_copy.py). The revision is not resident (no step can
        read it) until `commit`; `unreserve` gives the room back."""
        assert self.pool is not None, "asynchronous loads need the device pool"
        if revision in self._slot_of or revision in self.pool:
            raise ValueError(f"revision {revision[:12]} is already resident or reserved")
        return self._place(revision, weights, copy=False)

    def claim_slot(self, revision: str) -> int:
        """Give reserved `revision` its slot and slot-table entry now, while its copy runs, so the
        kernels' tables are brought up to date (at the next step) before the copy completes rather
        than after. Safe: until `commit` no step plan can name the slot (it maps no resident
        revision, and its facts are unknown, so `check` calls any data naming it stale)."""
        assert self.pool is not None and revision in self.pool.in_flight, revision[:12]
        slot = self._claimed.get(revision)
        if slot is None:
            slot = self._claimed[revision] = self._take_slot()
            self._generation[slot] = self._generation.get(slot, -1) + 1
            self.table.set(slot, self.pool.weights(revision))
            self.version += 1
        return slot

    def commit(self, revision: str) -> SlotFacts:
        """The copy into `revision`'s reserved room has completed: make it resident."""
        assert self.pool is not None and revision in self.pool.in_flight, revision[:12]
        slot = self.claim_slot(revision)
        del self._claimed[revision]
        self.pool.settle(revision)
        return self._resident(revision, slot, self.pool.weights(revision))

    def unreserve(self, revision: str) -> None:
        """Give back a reservation whose copy has completed or will never be read."""
        if self.pool is not None and revision in self.pool.in_flight:
            self.pool.free(revision)
            slot = self._claimed.pop(revision, None)
            if slot is not None:
                self._release(slot)

    def _place(self, revision: str, weights: AdapterWeights, copy: bool) -> AdapterWeights:
        assert self.pool is not None
        # PoolFullError leaves everything as it was. The pinned slots' adapters stay put: the
        # running step's kernels may be reading them.
        pinned = [r for r, s in self._slot_of.items() if s in self._pinned] if self._pinned else ()
        placement = self.pool.place(revision, weights, fixed=pinned, copy=copy)
        for moved, moved_weights in placement.moved.items():
            self._repoint(moved, moved_weights)
        return placement.weights

    def _install(self, revision: str, on_device: AdapterWeights) -> SlotFacts:
        slot = self._take_slot()
        self._generation[slot] = self._generation.get(slot, -1) + 1
        self.table.set(slot, on_device)
        return self._resident(revision, slot, on_device)

    def _resident(self, revision: str, slot: int, on_device: AdapterWeights) -> SlotFacts:
        # pool weights carry their facts from the pool's layout: nothing here walks the pairs
        ranks, groups, max_rank = on_device.ranks, on_device.groups, on_device.max_rank
        facts = SlotFacts(slot, self._generation[slot], ranks, groups, max_rank, on_device.nbytes)
        self._facts[slot] = facts
        self._slot_of[revision] = slot
        self.version += 1
        return facts

    def evict(self, revision: str) -> None:
        """Free `revision`'s slot for reuse. Refused while the running step has it pinned."""
        slot = self._slot_of.get(revision)
        if slot is None:
            return
        if slot in self._pinned:
            raise SlotInUseError(f"slot {slot} of revision {revision[:12]} is pinned by the running step")
        del self._slot_of[revision]
        if self.pool is not None:
            self.pool.free(revision)
        del self._facts[slot]
        self._release(slot)

    def _release(self, slot: int) -> None:
        """Empty `slot` for reuse (next generation)."""
        self.version += 1
        self._generation[slot] += 1
        self.table.clear(slot)
        self._free.append(slot)
        self._free.sort(reverse=True)

    def _repoint(self, revision: str, weights: AdapterWeights) -> None:
        """A compaction moved `revision`'s weights: same slot, new views, next generation (a step
        map built before the move is stale)."""
        slot = self._slot_of[revision]
        generation = self._generation[slot] + 1
        self._generation[slot] = generation
        old = self._facts[slot]
        self._facts[slot] = SlotFacts(slot, generation, old.ranks, old.groups, old.max_rank, old.nbytes)
        self.table.set(slot, weights)
        self.version += 1

    def weights(self, revision: str) -> AdapterWeights:
        """A resident revision's weights as the kernels read them (views into the pool)."""
        return self.table.weights(self._slot_of[revision])

    def resident_revisions(self) -> list[str]:
        return list(self._slot_of)

    def _take_slot(self) -> int:
        if self._free:
            return self._free.pop()
        slot = self._next_slot
        self._next_slot += 1
        return slot

    # --- state ------------------------------------------------------------------------------------

    def state(self, revision: str) -> Residency:
        return Residency.RESIDENT if revision in self._slot_of else Residency.PENDING

    def is_resident(self, revision: str) -> bool:
        return revision in self._slot_of

    def ensure(self, revision: str) -> Residency:
        """Start making `revision` resident; returns its state now. Every registered revision is
        loaded at registration today, so a pending one has no source to load from yet."""
        state = self.state(revision)
        if state is Residency.PENDING:
            raise LookupError(f"revision {revision[:12]} is not resident and has no source to load from")
        return state

    def facts(self, revision: str) -> SlotFacts:
        return self._facts[self._slot_of[revision]]

    def slot_facts(self, slot: int) -> SlotFacts:
        return self._facts[slot]

    @property
    def num_resident(self) -> int:
        return len(self._slot_of)

    @property
    def resident_bytes(self) -> int:
        return sum(f.nbytes for f in self._facts.values())

    # --- per step ---------------------------------------------------------------------------------

    def step_slots(self, adapters: Iterable[AdapterRef | None]) -> StepSlots:
        """The slot of each scheduled sequence's revision (None: base), pinned until `end_step`.
        (On every step's path: one pass over the rows, the rest over distinct slots only.)"""
        slot_of = self._slot_of
        slots = [BASE_SLOT if a is None else slot_of[a.revision] for a in adapters]
        pinned = set(slots)
        pinned.discard(BASE_SLOT)
        self._pinned = frozenset(pinned) if pinned else _NONE
        generation = self._generation
        return StepSlots(slots, {s: generation[s] for s in pinned})

    def repin(self, step: StepSlots) -> None:
        """Pin the slots of a map built earlier at this `version` (the caller checks it) for one
        more step: a steady decode batch plans the same sequences step after step."""
        self._pinned = frozenset(step.generations)

    def check(self, step: StepSlots) -> None:
        """Raise StaleSlotError if a slot of `step` changed content after the map was built."""
        for slot, generation in step.generations.items():
            if self._generation.get(slot) != generation or slot not in self._facts:
                raise StaleSlotError(
                    f"slot {slot} is at generation {self._generation.get(slot)}, the step was planned "
                    f"with {generation}"
                )

    def end_step(self) -> None:
        self._pinned = _NONE

    @property
    def pinned(self) -> frozenset[int]:
        return self._pinned
