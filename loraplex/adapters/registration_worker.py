"""The CPU-heavy half of a registration, runnable in a separate process.

    fetch -> checksums (and the caller's sha256) -> scan and convert -> revision -> store write

Reading, converting and hashing a large adapter is Python and torch work for seconds. On the
server's own threads it competes with the engine's step thread for the GIL and the cores, and
every step waits; in a worker process at the lowest CPU priority (one torch thread) it takes only
what the engine leaves. The server gets back only what it needs (revision, manifest, checksums)
and loads the weights from the store. `prepare` refuses with a ValueError naming the problem,
exactly as it would in process; the caller removes a stored file its transaction does not keep.
"""

from __future__ import annotations

import hashlib
import multiprocessing
import os
import threading
import time
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from loraplex.adapters.base_identity import BaseIdentity
from loraplex.adapters.peft_import import import_peft_adapter
from loraplex.adapters.revision import adapter_revision
from loraplex.adapters.sources import ADAPTER_FILES, OPTIONAL_FILES, SourcePolicy, fetch
from loraplex.adapters.store import AdapterStore
from loraplex.config import ModelConfig

WEIGHTS = "adapter_model.safetensors"


class ChecksumMismatch(ValueError):
    """The fetched weights are not the bytes the caller named."""


@dataclass(frozen=True)
class PrepareJob:
    source: str
    staging: Path  # an empty directory, removed by the caller
    policy: SourcePolicy
    model_config: ModelConfig
    max_rank: int
    base: BaseIdentity
    sha256: str | None  # the caller's expected sha256 of adapter_model.safetensors
    store_root: Path


@dataclass(frozen=True)
class Prepared:
    revision: str
    manifest: dict[str, Any]
    files: dict[str, str]  # per-file sha256 of what was fetched (provenance)


def prepare(job: PrepareJob) -> Prepared:
    """Fetch, verify, import and store one adapter; raises ValueError naming what was refused."""
    fetch(job.source, job.staging, job.policy)
    files = checksums(job.staging)
    if job.sha256 is not None and files[WEIGHTS] != job.sha256.lower():
        raise ChecksumMismatch(
            f"checksum mismatch: {WEIGHTS} has sha256 {files[WEIGHTS]}, the request expected "
            f"{job.sha256.lower()}"
        )
    imported = import_peft_adapter(job.staging, job.model_config, job.max_rank, job.base)
    revision = adapter_revision(imported)
    AdapterStore(job.store_root, clean=False).put(revision, imported)
    return Prepared(revision, imported.manifest, files)


def checksums(directory: Path) -> dict[str, str]:
    out = {}
    for name in (*ADAPTER_FILES, *OPTIONAL_FILES):
        if name not in ADAPTER_FILES and not (directory / name).is_file():
            continue
        digest = hashlib.sha256()
        with open(directory / name, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                digest.update(chunk)
        out[name] = digest.hexdigest()
    return out


def _background(parent: int) -> None:
    # The engine's step thread comes first: the worker takes the cores only when it is idle.
    os.nice(19)
    import torch

    torch.set_num_threads(1)
    # A server stopped by a signal exits without closing its pool; the worker must not outlive it
    # (it would also hold the server's stdout open).
    threading.Thread(target=_exit_with, args=(parent,), daemon=True).start()


def _exit_with(parent: int) -> None:
    while os.getppid() == parent:
        time.sleep(0.5)
    os._exit(0)


class WorkerProcess:
    """One long-lived worker process, started on first use (spawned: a fork of a process with
    running threads and CUDA state is unsafe). Calls run one at a time, in order."""

    def __init__(self) -> None:
        self._pool: ProcessPoolExecutor | None = None

    def __call__(self, job: PrepareJob) -> Prepared:
        if self._pool is None:
            context = multiprocessing.get_context("spawn")
            self._pool = ProcessPoolExecutor(
                1, mp_context=context, initializer=_background, initargs=(os.getpid(),)
            )
        try:
            result: Prepared = self._pool.submit(prepare, job).result()
        except BrokenProcessPool:
            self.close()  # the next registration starts a fresh worker
            raise RuntimeError("the registration worker process died") from None
        return result

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None
