"""Adapter names, immutable revisions, slots and request holds (in memory; persistence comes later).

A revision is the sha256 of the adapter's normalized content. Registering different content
under a name adds a revision and makes it the name's latest; identical content returns the
existing revision. Every revision stays addressable as `name@revision`. Requests resolve a name
to one revision when admitted and hold it until they finish, so a later registration never
changes a running request's weights.
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import torch

from loraplex.adapters.peft_import import ImportedAdapter, import_peft_adapter
from loraplex.adapters.revision import adapter_revision
from loraplex.config import ModelConfig
from loraplex.lora.metadata import BASE_SLOT
from loraplex.lora.weights import LoRASlotTable
from loraplex.types import ADAPTER_NAME_PATTERN, AdapterRef

_NAME = re.compile(ADAPTER_NAME_PATTERN)
_REVISION = re.compile(r"[0-9a-f]{6,64}")


class UnknownAdapterError(ValueError):
    """A request named an adapter (or revision) that is not registered."""


@dataclass(frozen=True)
class RegisteredRevision:
    ref: AdapterRef
    slot: int
    rank: int
    nbytes: int
    manifest: dict


class AdapterRegistry:
    def __init__(
        self,
        model_config: ModelConfig,
        max_rank: int,
        table: LoRASlotTable,
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> None:
        self.model_config = model_config
        self.max_rank = max_rank
        self.table = table
        self.dtype = dtype
        self.device = device
        self._revisions: dict[str, dict[str, RegisteredRevision]] = {}  # name -> revision -> entry
        self._latest: dict[str, str] = {}
        self._holds: Counter[AdapterRef] = Counter()
        self._next_slot = 0
        self._slot_of_revision: dict[str, int] = {}

    # --- registration -------------------------------------------------------------------------

    def register(self, name: str, path: str | Path) -> AdapterRef:
        """Import a PEFT adapter directory under `name`; raises ValueError naming any problem and
        changes nothing in that case."""
        check_adapter_name(name)
        imported = import_peft_adapter(path, self.model_config, self.max_rank)
        return self.register_imported(name, imported)

    def register_imported(self, name: str, imported: ImportedAdapter) -> AdapterRef:
        check_adapter_name(name)
        revision = adapter_revision(imported)
        revisions = self._revisions.setdefault(name, {})
        if revision not in revisions:
            # Identical content under another name shares one slot: the revision is the identity.
            slot = self._slot_of_revision.get(revision)
            if slot is None:
                slot = self._next_slot
                self._next_slot += 1
                self.table.set(slot, imported.weights.to(self.device, self.dtype))
                self._slot_of_revision[revision] = slot
            weights = self.table.weights(slot)
            revisions[revision] = RegisteredRevision(
                AdapterRef(name, revision), slot, weights.max_rank, weights.nbytes, imported.manifest
            )
        self._latest[name] = revision
        return revisions[revision].ref

    # --- lookup ---------------------------------------------------------------------------------

    def resolve(self, spec: str | AdapterRef) -> RegisteredRevision:
        """`name` (its latest revision) or `name@revision` (a full or unique prefix) -> revision;
        `name@` (an empty revision) is refused."""
        if isinstance(spec, AdapterRef):
            name, pinned, rev = spec.name, True, spec.revision
        else:
            if not isinstance(spec, str) or not spec:
                raise UnknownAdapterError(f"adapter must be a name or name@revision, got {spec!r}")
            name, at, rev = spec.partition("@")
            pinned = bool(at)
        if pinned and not rev:
            # A pin with nothing after the '@' (an unfilled template, a cut-off id) asked for one
            # revision: serving the latest instead would hide the mistake.
            raise UnknownAdapterError(
                f"{str(spec)!r}: the revision after '@' is empty (give name@revision, or the name alone "
                "for its latest revision)"
            )
        if not isinstance(spec, AdapterRef) and (
            not _NAME.fullmatch(name) or (rev and not _REVISION.fullmatch(rev))
        ):
            raise UnknownAdapterError(f"{spec!r} is not an adapter name or name@revision")
        revisions = self._revisions.get(name)
        if not revisions:
            raise UnknownAdapterError(f"unknown adapter {name!r}")
        if not rev:
            return revisions[self._latest[name]]
        matches = [r for r in revisions if r.startswith(rev)]
        if len(matches) != 1:
            what = "unknown" if not matches else "ambiguous"
            raise UnknownAdapterError(f"{what} revision {rev!r} of adapter {name!r}")
        return revisions[matches[0]]

    def list(self) -> list[RegisteredRevision]:
        return [entry for revs in self._revisions.values() for entry in revs.values()]

    def list_latest(self) -> list[RegisteredRevision]:
        """The latest revision of every name, in registration order of the names."""
        return [self._revisions[name][rev] for name, rev in self._latest.items()]

    def latest(self, name: str) -> AdapterRef:
        return self.resolve(name).ref

    # --- holds by requests ----------------------------------------------------------------------

    def acquire(self, spec: str | AdapterRef | None) -> tuple[AdapterRef | None, int]:
        if spec is None:
            return None, BASE_SLOT
        entry = self.resolve(spec)
        self._holds[entry.ref] += 1
        return entry.ref, entry.slot

    def release(self, ref: AdapterRef | None) -> None:
        if ref is None:
            return
        assert self._holds[ref] > 0, f"release of {ref} without a hold"
        self._holds[ref] -= 1
        if self._holds[ref] == 0:
            del self._holds[ref]

    def holds(self, ref: AdapterRef) -> int:
        return self._holds.get(ref, 0)


def check_adapter_name(name: str) -> None:
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise ValueError(
            f"invalid adapter name {name!r}: use letters, digits, '.', '_' and '-', "
            "starting with a letter or digit"
        )
