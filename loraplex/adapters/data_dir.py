"""The data directory (registry file, store) and its one-writer lock.

A server holds an exclusive lock on `<data dir>/writer.lock` for its lifetime; an offline CLI
that wants to write takes the same lock without waiting and, when a server holds it, is told
which process does (and should talk to that server instead). The lock is an OS file lock: it
goes away with the process that held it, however that process ended.
"""

from __future__ import annotations

import fcntl
import os
from pathlib import Path
from types import TracebackType


def default_data_dir() -> Path:
    """`LORAPLEX_DATA_DIR`, else the per-user data directory (`$XDG_DATA_HOME/loraplex`, by default
    `~/.local/share/loraplex`)."""
    explicit = os.environ.get("LORAPLEX_DATA_DIR")
    if explicit:
        return Path(explicit)
    base = os.environ.get("XDG_DATA_HOME") or str(Path.home() / ".local" / "share")
    return Path(base) / "loraplex"


class DataDirLockedError(RuntimeError):
    """Another process writes this data directory."""


class DataDirLock:
    def __init__(self, data_dir: str | Path) -> None:
        self.data_dir = Path(data_dir)
        self._fd: int | None = None

    def acquire(self) -> DataDirLock:
        self.data_dir.mkdir(parents=True, exist_ok=True)
        path = self.data_dir / "writer.lock"
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 64, 0).decode(errors="replace").strip() or "another process"
            os.close(fd)
            raise DataDirLockedError(
                f"{self.data_dir} is in use by process {holder} (a running server?): "
                "talk to that server (--url), or stop it first"
            ) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, str(os.getpid()).encode(), 0)
        self._fd = fd
        return self

    def release(self) -> None:
        if self._fd is not None:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None

    def __enter__(self) -> DataDirLock:
        return self.acquire()

    def __exit__(
        self, kind: type[BaseException] | None, err: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.release()
