"""The server's control plane: its data directory, the persistent registry and store, and the
engine's in-memory view of them (`adapters/registry.py`) kept in step.

At startup, before the engine thread runs, it takes the data directory's lock, registers the
startup adapters (`--adapter`, the demo's) through the same pipeline as the admin API (idempotent:
a restart finds them registered), and loads every active revision from the store, so a restart
serves everything without the original sources. While serving, every write runs on one worker
thread (one writer; never the engine's step thread, never the event loop): the registry first,
then the change goes to the engine thread as one command, so an admission sees all of it or none.
The admin API's operations are in `admin_ops.py`.
"""

from __future__ import annotations

import contextlib
import shutil
import sys
import tempfile
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from loraplex.adapters.control_plane import ControlPlane, RegistrationError, Runner
from loraplex.adapters.data_dir import DataDirLock
from loraplex.adapters.eviction import TenantLimits
from loraplex.adapters.peft_import import ImportedAdapter
from loraplex.adapters.registration_worker import WorkerProcess, prepare
from loraplex.adapters.registry_db import DEFAULT_TENANT, AdapterRecord, RegistryDB, RegistryError
from loraplex.adapters.sources import SourcePolicy
from loraplex.adapters.store import AdapterStore
from loraplex.adapters.tenant_residency import guarantee_overcommit, limits_from_record
from loraplex.server.auth import KeyTable, Principal, token_hash
from loraplex.server.errors import APIError
from loraplex.server.limits import TenantQuotas
from loraplex.types import AdapterRef

if TYPE_CHECKING:
    from loraplex.engine.engine import Engine
    from loraplex.server.async_engine import AsyncEngine

_T = TypeVar("_T")

STARTUP = "startup"  # the audit log's principal for what the server's own command line asked for
ADMIN_ENV = "LORAPLEX_ADMIN_KEY"
BASE_CACHE = "base-revisions.json"  # the base revision's stat cache, in the data directory


def manifest_bytes(manifest: dict[str, Any]) -> int:
    """Bytes of a revision's A and B matrices as stored (float32), from its manifest's shapes."""
    elements = sum(
        int(m["a_shape"][0]) * int(m["a_shape"][1]) + int(m["b_shape"][0]) * int(m["b_shape"][1])
        for m in manifest["modules"]
    )
    return 4 * elements


class ControlService:
    def __init__(self, data_dir: str | Path | None, engine: Engine, policy: SourcePolicy) -> None:
        """`data_dir` None: a temporary directory, removed at close (tests, embedded servers)."""
        self.temporary = data_dir is None
        self.data_dir = (
            Path(tempfile.mkdtemp(prefix="loraplex-data-")) if data_dir is None else Path(data_dir)
        )
        self.lock = DataDirLock(self.data_dir).acquire()
        try:
            self.db = RegistryDB.in_dir(str(self.data_dir))
        except BaseException:
            self.lock.release()
            raise
        self.store = AdapterStore(self.data_dir / "store")
        self.engine = engine
        # Hashed once here; a restart with unchanged files reads the revision from the stat cache.
        self.base = engine.identify_base(self.data_dir / BASE_CACHE)
        self.policy = policy
        # While serving, fetching, converting and hashing run in a worker process (started on the
        # first registration): on the server's threads they would slow every engine step.
        self.worker = WorkerProcess()
        self.plane = self._plane(policy, self.worker)
        self.async_engine: AsyncEngine | None = None  # set once the engine thread runs
        self.served_model = ""  # the base model's name in the API: no adapter or alias may take it
        self.keys = KeyTable()
        self.quotas: dict[str, TenantQuotas] = {
            name: TenantQuotas.from_mapping(q) for name, q in self.db.tenants().items()
        }
        # Each tenant's residency limits, as the engine's eviction policy enforces them (set here
        # before the engine thread runs; changed on it by `set_residency`).
        self.residency: dict[str, TenantLimits] = {
            name: limits_from_record(record) for name, record in self.db.residency().items()
        }
        engine.tiers.set_tenant_limits(self.residency)
        # Stored limits written offline (or under a larger budget) may promise more than this
        # server's pool holds: serve anyway, the eviction policy honours what fits, and say so.
        overcommit = guarantee_overcommit(self.residency, engine.tiers.pool.budget_bytes)
        if overcommit is not None:
            print(f"warning: {overcommit}; not every guarantee can hold at once", file=sys.stderr)
        # One writer thread: registrations, aliases, retirements, tenants and keys, in order.
        self.writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="loraplex-control")
        engine.admission.on_drained = self._drained
        # The disk tier: the engine reads an evicted adapter back from the store (on its loader
        # thread), so the host tier need not keep every registered adapter.
        store = self.store
        engine.tiers.source = lambda revision: store.get(revision).weights

    def _plane(self, policy: SourcePolicy, runner: Runner = prepare) -> ControlPlane:
        return ControlPlane(
            self.db,
            self.store,
            policy,
            self.engine.model_config,
            self.engine.config.lora.max_rank,
            self.data_dir / "staging",
            self.base,
            runner,
        )

    def close(self) -> None:
        self.writer.shutdown(wait=True, cancel_futures=True)
        self.worker.close()
        self.db.close()
        self.lock.release()
        if self.temporary:
            shutil.rmtree(self.data_dir, ignore_errors=True)

    # --- startup --------------------------------------------------------------------------------

    def register_startup(self, adapters: dict[str, str], progress: bool) -> None:
        """Register the command line's adapters (the operator named those directories, so they are
        allowed sources whatever the allow-list says); a restart finds them registered. In
        process: no engine step runs yet, and no worker process needs starting."""
        if not adapters:
            return
        roots = tuple(Path(p) for p in adapters.values())
        plane = self._plane(SourcePolicy(roots=roots))
        for name, path in adapters.items():
            reg = plane.register(name, path, STARTUP, tenant=DEFAULT_TENANT, visibility="shared")
            if progress:
                new = "registered" if reg.created else "already registered"
                print(f"  adapter {name}@{reg.revision[:12]} ({new})", file=sys.stderr)
            if not reg.created:
                self._say_what_the_name_serves(name, reg.revision)

    def _say_what_the_name_serves(self, name: str, revision: str) -> None:
        """A restart with the same `--adapter NAME=DIR` finds the directory's revision registered,
        but the registry decides what NAME serves: its newest active revision, which may have been
        published (or this one retired) since. The operator should not have to find that out from
        the outputs."""
        rec = self.db.get(name, revision)
        if rec is not None and rec.state != "active":
            print(
                f"warning: {name}@{revision[:12]} from the command line is {rec.state} in the "
                f"registry and is not served (a retired revision stays retired)",
                file=sys.stderr,
            )
            return
        try:
            served = self.db.resolve(name).revision
        except RegistryError:
            return
        if served != revision:
            print(
                f"warning: '{name}' serves {served[:12]}, published after {revision[:12]} (the "
                f"command line's directory); `loraplex adapters retire {name}@{served[:12]}` "
                f"to serve the directory's revision again",
                file=sys.stderr,
            )

    def load_registered(self) -> None:
        """Serve every active revision from the store, oldest first (so each name's newest is its
        latest), and every alias. A revision left draining by a stopped server has no requests
        any more: it is retired now. A revision made for another base (or recorded before base
        revisions were) is not served, and says so; its record stays for a server of its base."""
        skipped: set[tuple[str, str]] = set()
        for rec in sorted(self.db.list_adapters(include_retired=True), key=lambda r: r.created_at):
            made_for = rec.manifest.get("base_revision")
            if made_for != self.base.revision:
                skipped.add((rec.name, rec.revision))
                if rec.state != "active":
                    continue  # nothing to serve either way; its state moves on under its base
                print(
                    f"  not serving {rec.name}@{rec.revision[:12]}: made for base revision "
                    f"{made_for or '(unrecorded)'}, this server's base is {self.base.revision}",
                    file=sys.stderr,
                )
                continue
            if rec.state == "draining":
                self.db.set_state(rec.name, rec.revision, "retired", STARTUP)
            if rec.state != "active":
                self.engine.adapters.add_retired(
                    rec.name, rec.revision, rec.manifest, rec.tenant, rec.visibility
                )
                continue
            imported = self.store.get(rec.revision)
            self.engine.register_imported(rec.name, imported, rec.revision, rec.tenant, rec.visibility)
        for alias, (name, revision) in self.db.aliases().items():
            if (name, revision) in skipped:
                continue
            self.engine.adapters.set_alias(alias, AdapterRef(name, revision), restoring=True)

    def load_keys(self, data_tokens: list[str], admin_token: str | None) -> KeyTable:
        """The registry's live keys, the configured data keys (the default tenant's) and the
        environment's admin key, in one table the door checks from memory."""
        for key_hash, rec in self.db.live_keys().items():
            self.keys.add(key_hash, Principal(rec.role, rec.tenant, f"{rec.label}#{key_hash[:8]}"))
        for i, token in enumerate(data_tokens):
            self.keys.add(token_hash(token), Principal("data", DEFAULT_TENANT, f"configured key {i}"))
        if admin_token:
            self.keys.add(token_hash(admin_token), Principal("admin", DEFAULT_TENANT, ADMIN_ENV))
        return self.keys

    # --- while serving --------------------------------------------------------------------------

    def on_engine(self, fn: Callable[[Engine], _T]) -> _T:
        """Run `fn` on the engine thread (in order with admissions) once it runs; directly before."""
        if self.async_engine is not None and self.async_engine.alive:
            result: _T = self.async_engine.call(fn).result(timeout=120)
            return result
        return fn(self.engine)

    def check_guarantees(self, tenant: str, limits: TenantLimits) -> None:
        """A 409 when `tenant` with `limits` would make all tenants' guaranteed device bytes sum
        over the engine's adapter device budget (the server would promise bytes it does not have)."""
        proposed = {**self.residency, tenant: limits}
        overcommit = guarantee_overcommit(proposed, self.engine.tiers.pool.budget_bytes)
        if overcommit is not None:
            raise APIError(
                409,
                f"{overcommit} with this change (lower a guarantee, or serve with a larger "
                "--adapter-device-bytes)",
                param="guaranteed_bytes",
                code="guarantee_overcommit",
            )

    def set_residency(self, tenant: str, limits: TenantLimits) -> None:
        """A tenant's new residency limits, effective from the engine's next step (no restart)."""
        self.residency[tenant] = limits
        snapshot = dict(self.residency)
        self.on_engine(lambda e: e.tiers.set_tenant_limits(snapshot))

    def quotas_of(self, tenant: str) -> TenantQuotas:
        return self.quotas.get(tenant) or TenantQuotas()

    def quota_check(self, tenant: str) -> Callable[[dict[str, Any], str], None]:
        """The registration-time quotas of `tenant` (count, rank, bytes), as the pipeline's check."""
        quotas = self.quotas_of(tenant)

        def check(manifest: dict[str, Any], revision: str) -> None:
            mine = [r for r in self.db.list_adapters() if r.tenant == tenant]
            if any(r.revision == revision for r in mine):
                return  # identical content again: idempotent, it adds nothing
            size = sum(manifest_bytes(r.manifest) for r in mine) + manifest_bytes(manifest)
            try:
                quotas.check_registration(tenant, len(mine) + 1, int(manifest["max_rank"]), size)
            except APIError as err:
                raise RegistrationError(err.message, err.status) from None

        return check

    def serve_revision(self, rec: AdapterRecord) -> None:
        """Load a newly recorded revision from the store into the engine (the store read and its
        check run here, on the writer thread; the engine thread only places the weights)."""
        imported = self.store.get(rec.revision)
        weights = imported.weights.to(self.engine.device, self.engine.config.torch_dtype)
        ready = ImportedAdapter(weights, imported.manifest)
        self.on_engine(
            lambda e: e.register_imported(rec.name, ready, rec.revision, rec.tenant, rec.visibility)
        )

    def _drained(self, ref: AdapterRef) -> None:
        """Engine thread: the last request on a retired revision ended (its slot is freed unless
        another name serves the same content). Record it off this thread."""
        with contextlib.suppress(RuntimeError):  # the server is closing: the next startup retires it
            self.writer.submit(self._mark_retired, ref)

    def _mark_retired(self, ref: AdapterRef) -> None:
        # RegistryError: retired already (a restart's startup did it): nothing to record.
        with contextlib.suppress(RegistryError):
            self.db.set_state(ref.name, ref.revision, "retired", "engine (drained)")
