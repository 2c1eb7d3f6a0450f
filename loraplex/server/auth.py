"""Who is calling: bearer tokens -> principals, checked from memory.

Tokens are held only as their sha256 (the persistent registry stores no more than that either),
so a check is one hash and one dictionary lookup: no database query and no slow password hash per
request, and a guess learns nothing from timing but whether it was right. With no keys configured
the data plane is open and every caller is the default tenant's data principal.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from dataclasses import dataclass

DEFAULT_TENANT = "default"


@dataclass(frozen=True)
class Principal:
    role: str  # data | admin
    tenant: str
    label: str  # who, in the audit log: a key's label and the start of its hash


ANONYMOUS = Principal("data", DEFAULT_TENANT, "anonymous")


def token_hash(token: str) -> str:
    return hashlib.sha256(token.encode("utf-8", "surrogatepass")).hexdigest()


class KeyTable:
    def __init__(self, hashed: dict[str, Principal] | None = None) -> None:
        self._by_hash: dict[str, Principal] = dict(hashed or {})
        # Open (no keys) only until a first key exists: revoking every key must lock the server,
        # not open it to anyone.
        self._keyed = bool(self._by_hash)

    @classmethod
    def from_tokens(cls, tokens: Iterable[str], role: str = "data", tenant: str = DEFAULT_TENANT) -> KeyTable:
        """Keys given in clear (`--api-key`, `LORAPLEX_API_KEYS`), all of one role and tenant."""
        return cls(
            {token_hash(t): Principal(role, tenant, f"configured key {i}") for i, t in enumerate(tokens)}
        )

    def add(self, key_hash: str, principal: Principal) -> None:
        # One dictionary assignment: the event loop's lookups see the key or not, never half of it.
        self._by_hash[key_hash] = principal
        self._keyed = True

    def remove(self, key_hash: str) -> None:
        self._by_hash.pop(key_hash, None)

    def __bool__(self) -> bool:
        """Whether keys are required (some key exists, or existed)."""
        return self._keyed

    def authenticate(self, authorization: str) -> Principal | None:
        """The principal of an `Authorization: Bearer <token>` header; None if it names none."""
        if not self._keyed:
            return ANONYMOUS
        scheme, _, credentials = authorization.partition(" ")
        if scheme.lower() != "bearer":
            return None
        return self._by_hash.get(token_hash(credentials.strip()))
