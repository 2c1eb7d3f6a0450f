"""Registering an adapter from a source, as one transaction:

    fetch (allow-listed source, size limits) -> verify (the caller's sha256, if given)
    -> scan and convert (safetensors only, never unpickled; ranks, shapes, targets, NaN/Inf)
    -> store (content-addressed, atomic) -> record (the persistent registry)

A failure at any step records nothing, leaves no file in the store that was not there before,
and is written to the audit log with its reason; registering identical content again is
idempotent. Loading the weights into the serving engine is residency's business, not this one's.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from loraplex.adapters.peft_import import ImportedAdapter, import_peft_adapter
from loraplex.adapters.registry import check_adapter_name
from loraplex.adapters.registry_db import DEFAULT_TENANT, RegistryDB, RegistryError
from loraplex.adapters.revision import adapter_revision
from loraplex.adapters.sources import ADAPTER_FILES, SourcePolicy, fetch
from loraplex.adapters.store import AdapterStore
from loraplex.config import ModelConfig


class RegistrationError(ValueError):
    """A registration the control plane refused; the message names the step and the reason.
    `status`: the HTTP status the server answers with (400 bad input; a quota's 403 or 413)."""

    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.status = status


@dataclass(frozen=True)
class Registration:
    name: str
    revision: str
    manifest: dict[str, Any]
    created: bool  # False: this name already had this revision (idempotent re-registration)


class ControlPlane:
    def __init__(
        self,
        db: RegistryDB,
        store: AdapterStore,
        policy: SourcePolicy,
        model_config: ModelConfig,
        max_rank: int,
        staging_root: Path,
    ) -> None:
        self.db = db
        self.store = store
        self.policy = policy
        self.model_config = model_config
        self.max_rank = max_rank
        self.staging_root = staging_root
        staging_root.mkdir(parents=True, exist_ok=True)

    def register(
        self,
        name: str,
        source: str,
        principal: str,
        sha256: str | None = None,
        tenant: str = DEFAULT_TENANT,
        visibility: str = "private",
        check: Callable[[ImportedAdapter, str], None] | None = None,
    ) -> Registration:
        """`check(imported, revision)`: called before anything is stored (the server's per-tenant
        quotas); a ValueError from it refuses the registration like any other step."""
        staging = Path(tempfile.mkdtemp(prefix="fetch-", dir=self.staging_root))
        stored_now = False
        revision = ""
        try:
            try:
                check_adapter_name(name)
                fetch(source, staging, self.policy)
                files = _checksums(staging)
                if sha256 is not None and files["adapter_model.safetensors"] != sha256.lower():
                    raise RegistrationError(
                        f"checksum mismatch: adapter_model.safetensors has sha256 "
                        f"{files['adapter_model.safetensors']}, the request expected {sha256.lower()}"
                    )
                imported = import_peft_adapter(staging, self.model_config, self.max_rank)
                revision = adapter_revision(imported)
                if check is not None:
                    check(imported, revision)
                stored_now = revision not in self.store
                self.store.put(revision, imported)
                provenance = {
                    "source": source,
                    "files": files,
                    "registered_at": dt.datetime.now(dt.UTC).isoformat(),
                    "principal": principal,
                }
                created = self.db.add_revision(
                    name, revision, imported.manifest, provenance, principal, tenant, visibility
                )
            except RegistryError as err:
                raise RegistrationError(str(err)) from None  # the registry audited it already
            except ValueError as err:  # fetch, checksum, import and store refusals
                reason = str(err).replace(str(staging), source)  # name what the caller sent
                self.db.record_refusal(principal, "register", f"{name} from {source}", reason)
                raise RegistrationError(reason, getattr(err, "status", 400)) from None
        except BaseException:
            if stored_now:  # nobody else refers to a file this attempt added
                self.store.remove(revision)
            raise
        finally:
            shutil.rmtree(staging, ignore_errors=True)
        return Registration(name, revision, imported.manifest, created)


def _checksums(directory: Path) -> dict[str, str]:
    out = {}
    for name in ADAPTER_FILES:
        digest = hashlib.sha256()
        with open(directory / name, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                digest.update(chunk)
        out[name] = digest.hexdigest()
    return out
