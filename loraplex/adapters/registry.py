"""Adapter identity as the engine serves it: names, immutable revisions, aliases, owners, retired
revisions and request holds, in memory (the persistent registry, `registry_db.py`, is the record the
server rebuilds this from). No tensors and no devices here: where a revision's weights are is
residency's business (`residency.py`), so this module imports no torch.

A revision is the sha256 of the adapter's normalized content. Adding different content under a
name adds a revision and makes it the name's latest; identical content returns the existing
revision. Every revision stays addressable as `name@revision`. Requests resolve a name to one
revision when admitted and hold it until they finish, so a later registration never changes a
running request's weights.

Aliases point at one revision and are repointed in one assignment on the engine thread, so an
admission sees the old target or the new one. A retired revision takes no new requests (resolving
it raises RetiredAdapterError, which names it retired); requests holding it finish on it, and
`release` says when the last of them is gone, so its memory can be freed. A tenant sees its own
revisions and shared ones; another tenant's private revision resolves exactly like an unknown one.
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
DEFAULT_TENANT = "default"


class UnknownAdapterError(ValueError):
    """A request named an adapter (or revision) that is not registered."""


class RetiredAdapterError(UnknownAdapterError):
    """A request named a retired revision (or a name whose revisions are all retired)."""


@dataclass(frozen=True)
class RegisteredRevision:
    ref: AdapterRef
    rank: int  # the largest rank over the adapter's modules
    nbytes: int  # bytes of its A and B matrices in the serving dtype
    manifest: dict[str, Any]
    tenant: str = DEFAULT_TENANT
    visibility: str = "shared"  # shared: every tenant may use it; private: its tenant only

    def usable_by(self, tenant: str | None) -> bool:
        """None: no tenant filter (the offline API and the engine's own callers)."""
        return tenant is None or self.visibility == "shared" or self.tenant == tenant


class AdapterRegistry:
    def __init__(self) -> None:
        self._revisions: dict[str, dict[str, RegisteredRevision]] = {}  # name -> revision -> entry
        self._latest: dict[str, str] = {}
        self._holds: Counter[AdapterRef] = Counter()
        self._aliases: dict[str, AdapterRef] = {}
        self._retired: set[AdapterRef] = set()

    # --- registration -------------------------------------------------------------------------

    def add(
        self,
        name: str,
        revision: str,
        rank: int,
        nbytes: int,
        manifest: dict[str, Any],
        tenant: str = DEFAULT_TENANT,
        visibility: str = "shared",
    ) -> AdapterRef:
        """Record `revision` under `name` and make it the name's latest. The caller has verified
        and loaded the content; a revision already known under this name is returned as it is."""
        check_adapter_name(name)
        revisions = self._revisions.setdefault(name, {})
        if revision not in revisions:
            revisions[revision] = RegisteredRevision(
                AdapterRef(name, revision), rank, nbytes, manifest, tenant, visibility
            )
        ref = revisions[revision].ref
        if ref in self._retired:
            raise ValueError(f"{name}@{revision[:12]} is retired; a retired revision stays retired")
        self._latest[name] = revision
        return ref

    def add_retired(
        self, name: str, revision: str, manifest: dict[str, Any], tenant: str, visibility: str
    ) -> None:
        """Know a revision retired before this process started (never loaded): its name and pins
        are answered as retired, not as unknown."""
        check_adapter_name(name)
        ref = AdapterRef(name, revision)
        rank = int(manifest.get("max_rank", 0))
        self._revisions.setdefault(name, {})[revision] = RegisteredRevision(
            ref, rank, 0, manifest, tenant, visibility
        )
        self._retired.add(ref)

    def set_alias(self, alias: str, ref: AdapterRef, restoring: bool = False) -> None:
        """Point `alias` at a registered, live revision (one assignment: atomic for admissions).
        `restoring`: an alias read back at startup may point at a retired revision (and answers
        so)."""
        entry = self._revisions.get(ref.name, {}).get(ref.revision) if restoring else None
        if entry is None:
            entry = self.resolve(ref)  # unknown or retired: raises, the alias stays as it was
        if alias in self._revisions:
            raise ValueError(f"alias {alias!r} is an adapter's name")
        self._aliases[alias] = entry.ref

    def aliases(self, tenant: str | None = None) -> dict[str, AdapterRef]:
        """alias -> its live target, among the revisions `tenant` may use."""
        return {
            alias: ref
            for alias, ref in self._aliases.items()
            if ref not in self._retired and self._revisions[ref.name][ref.revision].usable_by(tenant)
        }

    def retire(self, ref: AdapterRef) -> bool:
        """Take `ref` out of service: no new request may resolve to it. True when no request holds
        it (its memory may be freed now); otherwise `release` says when the last hold is gone."""
        entry = self.resolve(ref)
        self._retired.add(entry.ref)
        if self._latest.get(ref.name) == ref.revision:
            live = [r for r in self._revisions[ref.name] if AdapterRef(ref.name, r) not in self._retired]
            if live:
                self._latest[ref.name] = live[-1]
            else:
                del self._latest[ref.name]
        return self._holds.get(entry.ref, 0) == 0

    def is_retired(self, ref: AdapterRef) -> bool:
        return ref in self._retired

    def in_service(self, revision: str) -> bool:
        """Some name serves `revision` (not retired) or some request holds it: its weights stay."""
        return any(
            revision in revs and AdapterRef(name, revision) not in self._retired
            for name, revs in self._revisions.items()
        ) or any(ref.revision == revision for ref in self._holds)

    # --- lookup ---------------------------------------------------------------------------------

    def resolve(self, spec: str | AdapterRef, tenant: str | None = None) -> RegisteredRevision:
        """An alias, `name` (its latest revision) or `name@revision` (a full or unique prefix) ->
        revision; `name@` (an empty revision) is refused, and so is a retired revision. With a
        tenant, only the revisions it may use exist."""
        if isinstance(spec, str) and spec in self._aliases:
            ref = self._aliases[spec]
            entry = self._revisions[ref.name][ref.revision]
            if not entry.usable_by(tenant):
                raise UnknownAdapterError(f"unknown adapter {spec!r}")
            if ref in self._retired:
                raise RetiredAdapterError(
                    f"alias {spec!r} points at {ref.name}@{ref.revision[:12]}, which is retired"
                )
            return entry
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
        if revisions and tenant is not None:
            revisions = {r: e for r, e in revisions.items() if e.usable_by(tenant)}
        if not revisions:
            raise UnknownAdapterError(f"unknown adapter {name!r}")
        if not rev:
            return self._latest_of(name, revisions)
        matches = [r for r in revisions if r.startswith(rev)]
        if len(matches) != 1:
            what = "unknown" if not matches else "ambiguous"
            raise UnknownAdapterError(f"{what} revision {rev!r} of adapter {name!r}")
        entry = revisions[matches[0]]
        if entry.ref in self._retired:
            raise RetiredAdapterError(f"adapter {name}@{entry.ref.revision[:12]} is retired")
        return entry

    def _latest_of(self, name: str, revisions: dict[str, RegisteredRevision]) -> RegisteredRevision:
        """The name's latest live revision among `revisions` (those the caller may use)."""
        latest = self._latest.get(name)
        if latest in revisions:
            return revisions[latest]
        live = [e for e in revisions.values() if e.ref not in self._retired]
        if not live:
            raise RetiredAdapterError(f"adapter {name!r} is retired (every revision of it)")
        return live[-1]

    def list(self) -> list[RegisteredRevision]:
        return [entry for revs in self._revisions.values() for entry in revs.values()]

    def list_latest(self, tenant: str | None = None) -> builtins.list[RegisteredRevision]:
        """The latest live revision of every name `tenant` may use, in registration order."""
        out = []
        for name in self._latest:
            revisions = {r: e for r, e in self._revisions[name].items() if e.usable_by(tenant)}
            live = [e for e in revisions.values() if e.ref not in self._retired]
            if live:
                out.append(self._latest_of(name, revisions))
        return out

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

    def release(self, ref: AdapterRef | None) -> bool:
        """End one request's hold; True when that was the last hold of a retired revision (its
        memory may be freed now)."""
        if ref is None:
            return False
        assert self._holds[ref] > 0, f"release of {ref} without a hold"
        self._holds[ref] -= 1
        if self._holds[ref] == 0:
            del self._holds[ref]
            return ref in self._retired
        return False

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
