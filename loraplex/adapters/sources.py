"""Where adapter files may come from, and fetching them into a staging directory.

The control plane fetches; the data plane never names a path or URL. A source is one of:

    a local directory   only under an allow-listed root: `..` components are refused, the path is
                        resolved (symlinks too) and must still lie under a root
    http(s)://host/dir  only on an allow-listed host; no redirects (a redirect could leave the list)
    s3://bucket/prefix  only in an allow-listed bucket, through s3fs (credentials and endpoint from
                        the environment, or `s3_endpoint` for an S3-compatible server)

Only the files an adapter consists of are fetched (`adapter_config.json`,
`adapter_model.safetensors`, and where present the optional `loraplex.json` naming its base
revision and tokenizer files, which registration compares with the served base's); each is read
in chunks and the fetch stops the moment a file or the
total passes its limit, so an endless body costs at most the limit. Remote reads go through fsspec.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from loraplex.adapters.base_identity import BASE_FILE, TOKENIZER_FILES

ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors")
OPTIONAL_FILES = (BASE_FILE, *TOKENIZER_FILES)  # fetched when the source has them
_CHUNK = 1 << 20


class SourceError(ValueError):
    """A source the policy refuses, or a fetch that failed; the message names the reason."""


@dataclass(frozen=True)
class SourcePolicy:
    roots: tuple[Path, ...] = field(default_factory=tuple)  # local directories sources may lie under
    hosts: tuple[str, ...] = field(default_factory=tuple)  # host names (host:port where not 80/443)
    buckets: tuple[str, ...] = field(default_factory=tuple)  # s3 buckets
    s3_endpoint: str | None = None  # an S3-compatible server's URL (None: AWS's, from the environment)
    max_file_bytes: int = 2 << 30
    max_total_bytes: int = 4 << 30

    def __post_init__(self) -> None:
        object.__setattr__(self, "roots", tuple(Path(r).resolve() for r in self.roots))


def fetch(source: str, staging: Path, policy: SourcePolicy) -> Path:
    """Copy the adapter at `source` into the empty directory `staging`; returns `staging`."""
    if not isinstance(source, str) or not source:
        raise SourceError("the source must be a non-empty string")
    staging.mkdir(parents=True, exist_ok=True)
    scheme = urlsplit(source).scheme
    try:
        if scheme in ("http", "https"):
            _fetch_http(source, staging, policy)
        elif scheme == "s3":
            _fetch_s3(source, staging, policy)
        elif scheme in ("", "file"):
            _fetch_local(source.removeprefix("file://"), staging, policy)
        else:
            raise SourceError(f"unsupported source scheme {scheme!r} (local paths, http(s) and s3 URLs)")
    except BaseException:
        for name in (*ADAPTER_FILES, *OPTIONAL_FILES):  # a refused fetch leaves nothing, not half
            (staging / name).unlink(missing_ok=True)
        raise
    return staging


def local_dir(source: str, policy: SourcePolicy) -> Path:
    """The resolved directory of a local source, if the policy allows it."""
    if not policy.roots:
        raise SourceError("local sources are not allowed: no source roots are configured")
    if ".." in Path(source).parts:
        raise SourceError(f"{source!r}: '..' is not allowed in a source path")
    try:
        resolved = Path(source).resolve(strict=True)
    except (OSError, RuntimeError) as err:
        raise SourceError(f"{source!r}: not found ({err.__class__.__name__})") from None
    if not any(resolved.is_relative_to(root) for root in policy.roots):
        raise SourceError(f"{source!r} is outside the allowed source roots")
    if not resolved.is_dir():
        raise SourceError(f"{source!r} is not a directory")
    return resolved


def _fetch_local(source: str, staging: Path, policy: SourcePolicy) -> None:
    directory = local_dir(source, policy)
    total = 0
    for name in (*ADAPTER_FILES, *OPTIONAL_FILES):
        path = directory / name
        if name in OPTIONAL_FILES and not path.is_symlink() and not path.exists():
            continue
        resolved = path.resolve()
        # each file too: a symlink inside an allowed directory may point anywhere
        if not any(resolved.is_relative_to(root) for root in policy.roots):
            raise SourceError(f"{name} in {source!r} links outside the allowed source roots")
        if not resolved.is_file():
            raise SourceError(f"{source!r} has no {name}")
        with open(resolved, "rb") as f:
            total += _copy_limited(_chunks(f), staging / name, name, total, policy)


def _fetch_http(source: str, staging: Path, policy: SourcePolicy) -> None:
    import fsspec  # the remote-source packages load only when a remote source is used

    parts = urlsplit(source)
    if parts.username or parts.password:
        raise SourceError("credentials in a source URL are not accepted")
    host = parts.hostname or ""
    port = parts.port
    named = host if port in (None, 80, 443) else f"{host}:{port}"
    if named not in policy.hosts:
        raise SourceError(f"host {named!r} is not an allowed source host")
    fs = fsspec.filesystem("http", client_kwargs={}, skip_instance_cache=True)
    base = source.rstrip("/")

    @contextmanager
    def open_file(name: str) -> Iterator[Any]:
        url = f"{base}/{name}"
        with fs.open(url, "rb", block_size=0, allow_redirects=False) as f:
            # fsspec raises for 4xx/5xx only; a redirect (not followed) must not pass as a body
            status = getattr(getattr(f, "r", None), "status", 200)
            if status != 200:
                raise SourceError(f"{url}: fetch failed (HTTP {status}; redirects are not followed)")
            yield f

    _fetch_remote(open_file, base, staging, policy)


def _fetch_s3(source: str, staging: Path, policy: SourcePolicy) -> None:
    import fsspec

    parts = urlsplit(source)
    if parts.username or parts.password:
        raise SourceError("credentials in a source URL are not accepted")
    bucket = parts.hostname or ""
    if bucket not in policy.buckets:
        raise SourceError(f"bucket {bucket!r} is not an allowed source bucket")
    if ".." in parts.path.split("/"):
        raise SourceError(f"{source!r}: '..' is not allowed in a source path")
    client = {"endpoint_url": policy.s3_endpoint} if policy.s3_endpoint else {}
    fs = fsspec.filesystem("s3", client_kwargs=client, skip_instance_cache=True)
    base = f"{bucket}/{parts.path.strip('/')}".rstrip("/")
    _fetch_remote(
        lambda name: fs.open(f"{base}/{name}", "rb", block_size=_CHUNK, cache_type="none"),
        f"s3://{base}",
        staging,
        policy,
    )


def _fetch_remote(
    open_file: Callable[[str], AbstractContextManager[Any]], base: str, staging: Path, policy: SourcePolicy
) -> None:
    """Copy the adapter files (optional ones when present) from a remote location into staging,
    within the size limits; every failure is a SourceError naming the file's address."""
    total = 0
    for name in (*ADAPTER_FILES, *OPTIONAL_FILES):
        where = f"{base}/{name}"
        try:
            with open_file(name) as f:
                total += _copy_limited(_chunks(f), staging / name, name, total, policy)
        except SourceError:
            raise
        except FileNotFoundError:
            if name in OPTIONAL_FILES:
                continue
            raise SourceError(f"{where}: not found") from None
        except Exception as err:  # network, HTTP errors, credentials, permissions
            raise SourceError(f"{where}: fetch failed ({err.__class__.__name__}: {err})") from None


def _chunks(f: Any) -> Iterator[bytes]:  # noqa: ANN401
    while True:
        chunk = f.read(_CHUNK)
        if not chunk:
            return
        yield chunk


def _copy_limited(
    chunks: Iterator[bytes], dest: Path, name: str, total_before: int, policy: SourcePolicy
) -> int:
    """Write the chunks to `dest`, stopping (and removing `dest`) past a limit; returns the size."""
    size = 0
    try:
        with open(dest, "wb") as out:
            for chunk in chunks:
                size += len(chunk)
                if size > policy.max_file_bytes:
                    raise SourceError(f"{name} is larger than the limit of {policy.max_file_bytes} bytes")
                if total_before + size > policy.max_total_bytes:
                    raise SourceError(
                        f"the adapter is larger than the limit of {policy.max_total_bytes} bytes"
                    )
                out.write(chunk)
            out.flush()
            os.fsync(out.fileno())
    except BaseException:
        dest.unlink(missing_ok=True)
        raise
    return size


def clear(staging: Path) -> None:
    shutil.rmtree(staging, ignore_errors=True)
