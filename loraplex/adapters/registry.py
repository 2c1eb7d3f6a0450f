"""Adapter identity: names, immutable revisions and request holds (in memory; persistence comes
later). No tensors and no devices here: where a revision's weights are is residency's business
(`residency.py`), so this module imports no torch.

A revision is the sha256 of the adapter's normalized content. Adding different content under a
name adds a revision and makes it the name's latest; identical content returns the existing
revision. Every revision stays addressable as `name@revision`. Requests resolve a name to one
revision when admitted and hold it until they finish, so a later registration never changes a
running request's weights.
"""

from __future__ import annotations

import builtins
import re
from collections import Counter
from dataclasses import dataclass
from typing import Any

from loraplex.types import ADAPTER_NAME_PATTERN, AdapterRef

_NAME = re.compile(ADAPTER_NAME_PATTERN)
_REVISION = re.compile(r"[0-9a-f]{6,64}")


class UnknownAdapterError(ValueError):
    """A request named an adapter (or revision) that is not registered."""


@dataclass(frozen=True)
class RegisteredRevision:
    ref: AdapterRef
    rank: int  # the largest rank over the adapter's modules
    nbytes: int  # bytes of its A and B matrices in the serving dtype
    manifest: dict[str, Any]


class AdapterRegistry:
    def __init__(self) -> None:
        self._revisions: dict[str, dict[str, RegisteredRevision]] = {}  # name -> revision -> entry
        self._latest: dict[str, str] = {}
        self._holds: Counter[AdapterRef] = Counter()

    # --- registration -------------------------------------------------------------------------

    def add(self, name: str, revision: str, rank: int, nbytes: int, manifest: dict[str, Any]) -> AdapterRef:
        """Record `revision` under `name` and make it the name's latest. The caller has verified
        and loaded the content; a revision already known under this name is returned as it is."""
        check_adapter_name(name)
        revisions = self._revisions.setdefault(name, {})
        if revision not in revisions:
            revisions[revision] = RegisteredRevision(AdapterRef(name, revision), rank, nbytes, manifest)
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

    def list_latest(self) -> builtins.list[RegisteredRevision]:
        """The latest revision of every name, in registration order of the names."""
        return [self._revisions[name][rev] for name, rev in self._latest.items()]

    def latest(self, name: str) -> AdapterRef:
        return self.resolve(name).ref

    # --- holds by requests ----------------------------------------------------------------------

    def acquire(self, spec: str | AdapterRef | None) -> AdapterRef | None:
        """Resolve `spec` and hold the revision for one request (None: the base model)."""
        if spec is None:
            return None
        entry = self.resolve(spec)
        self._holds[entry.ref] += 1
        return entry.ref

    def release(self, ref: AdapterRef | None) -> None:
        if ref is None:
            return
        assert self._holds[ref] > 0, f"release of {ref} without a hold"
        self._holds[ref] -= 1
        if self._holds[ref] == 0:
            del self._holds[ref]

    def holds(self, ref: AdapterRef) -> int:
        return self._holds.get(ref, 0)

    def held_revisions(self) -> builtins.set[str]:
        """Revisions some live request holds (residency must keep them loadable)."""
        return {ref.revision for ref in self._holds}


def check_adapter_name(name: str) -> None:
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise ValueError(
            f"invalid adapter name {name!r}: use letters, digits, '.', '_' and '-', "
            "starting with a letter or digit"
        )
