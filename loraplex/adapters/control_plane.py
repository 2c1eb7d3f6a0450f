"""Registering an adapter from a source, as one transaction:

    fetch (allow-listed source, size limits) -> verify (the caller's sha256, if given)
    -> scan and convert (safetensors only, never unpickled; ranks, shapes, targets, NaN/Inf; the
       base revision and tokenizer it records must be the served base's)
    -> store (content-addressed, atomic) -> check (the caller's quotas) -> record (the registry)

The steps up to the store write are `registration_worker.prepare`: in process by default, in a
worker process when the server runs one (so a large adapter does not slow the engine's steps).
A failure at any step records nothing, leaves no file in the store that was not there before,
and is written to the audit log with its reason; registering identical content again is
idempotent. Loading the weights into the serving engine is residency's business, not this one's.
"""

from __future__ import annotations

import datetime as dt
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from loraplex.adapters.base_identity import BaseIdentity
from loraplex.adapters.registration_worker import Prepared, PrepareJob, prepare
from loraplex.adapters.registry import check_adapter_name
from loraplex.adapters.registry_db import DEFAULT_TENANT, RegistryDB, RegistryError
from loraplex.adapters.sources import SourcePolicy
from loraplex.adapters.store import AdapterStore
from loraplex.config import ModelConfig

Runner = Callable[[PrepareJob], Prepared]


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
        base: BaseIdentity,
        runner: Runner = prepare,
    ) -> None:
        """`base`: the served base's identity (adapters for another are refused); `runner` runs
        `prepare` (in process, or a `registration_worker.WorkerProcess`)."""
        self.db = db
        self.store = store
        self.policy = policy
        self.model_config = model_config
        self.max_rank = max_rank
        self.staging_root = staging_root
        self.base = base
        self.runner = runner
        staging_root.mkdir(parents=True, exist_ok=True)

    def register(
        self,
        name: str,
        source: str,
        principal: str,
        sha256: str | None = None,
        tenant: str = DEFAULT_TENANT,
        visibility: str = "private",
        check: Callable[[dict[str, Any], str], None] | None = None,
    ) -> Registration:
        """`check(manifest, revision)`: called before anything is recorded (the server's
        per-tenant quotas); a ValueError from it refuses the registration like any other step."""
        staging = Path(tempfile.mkdtemp(prefix="fetch-", dir=self.staging_root))
        before = set(self.store.revisions())  # one writer: whatever appears beyond it is ours
        try:
            try:
                check_adapter_name(name)
                job = PrepareJob(
                    source, staging, self.policy, self.model_config, self.max_rank, self.base, sha256,
                    self.store.root,
                )  # fmt: skip
                prepared = self.runner(job)
                if check is not None:
                    check(prepared.manifest, prepared.revision)
                provenance = {
                    "source": source,
                    "files": prepared.files,
                    "registered_at": dt.datetime.now(dt.UTC).isoformat(),
                    "principal": principal,
                }
                created = self.db.add_revision(
                    name, prepared.revision, prepared.manifest, provenance, principal, tenant, visibility
                )
            except RegistryError as err:
                raise RegistrationError(str(err)) from None  # the registry audited it already
            except (ValueError, RuntimeError) as err:  # refusals of every step; a dead worker
                reason = str(err).replace(str(staging), source)  # name what the caller sent
                self.db.record_refusal(principal, "register", f"{name} from {source}", reason)
                status = getattr(err, "status", 400 if isinstance(err, ValueError) else 500)
                raise RegistrationError(reason, status) from None
        except BaseException:
            for revision in set(self.store.revisions()) - before:  # nobody else refers to them
                self.store.remove(revision)
            raise
        finally:
            shutil.rmtree(staging, ignore_errors=True)
        return Registration(name, prepared.revision, prepared.manifest, created)
