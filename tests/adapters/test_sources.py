"""Adapter sources: local directories only under allow-listed roots (no `..`, no symlink escape),
http(s) only from allow-listed hosts through a real HTTP server on 127.0.0.1 (started and stopped
here), no redirects, and size limits that stop a fetch, even of an endless body, at the limit."""

from __future__ import annotations

import http.server
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

pytest.importorskip("fsspec")  # a server-side package: the GPU machine's image may lack it

from loraplex.adapters.sources import SourceError, SourcePolicy, fetch  # noqa: E402

CONFIG = b'{"peft_type": "LORA"}'
WEIGHTS = b"\x00" * 5000


def _adapter(directory: Path) -> Path:
    directory.mkdir(parents=True)
    (directory / "adapter_config.json").write_bytes(CONFIG)
    (directory / "adapter_model.safetensors").write_bytes(WEIGHTS)
    return directory


def test_local_sources_stay_under_their_roots(tmp_path: Path) -> None:
    root = tmp_path / "root"
    good = _adapter(root / "sql")
    outside = _adapter(tmp_path / "elsewhere")
    (root / "escape").symlink_to(outside, target_is_directory=True)
    sneaky = root / "sneaky"
    sneaky.mkdir()
    (sneaky / "adapter_config.json").write_bytes(CONFIG)
    (sneaky / "adapter_model.safetensors").symlink_to(outside / "adapter_model.safetensors")
    secret = tmp_path / "secret.json"
    secret.write_text("{}")
    vocab = _adapter(root / "vocab")
    (vocab / "tokenizer.json").symlink_to(secret)  # an optional file escapes as surely
    policy = SourcePolicy(roots=(root,))

    got = fetch(str(good), tmp_path / "stage-ok", policy)
    assert (got / "adapter_model.safetensors").read_bytes() == WEIGHTS
    assert fetch(f"file://{good}", tmp_path / "stage-file", policy).is_dir()
    cases = {
        str(root / "sql" / ".." / "sql"): "'..'",
        str(outside): "outside the allowed source roots",
        str(root / "escape"): "outside the allowed source roots",  # a symlinked directory
        str(sneaky): "links outside",  # a symlinked file
        str(vocab): "tokenizer.json in .* links outside",
        str(root / "missing"): "not found",
        "ftp://host/x": "unsupported source scheme",
    }
    for i, (source, why) in enumerate(cases.items()):
        stage = tmp_path / f"stage-{i}"
        with pytest.raises(SourceError, match=why):
            fetch(source, stage, policy)
        assert not any(p.is_file() for p in stage.rglob("*")), source  # nothing half-fetched
    with pytest.raises(SourceError, match="no source roots"):
        fetch(str(good), tmp_path / "stage-x", SourcePolicy())
    with pytest.raises(SourceError, match="larger than the limit"):
        fetch(str(good), tmp_path / "stage-big", SourcePolicy(roots=(root,), max_file_bytes=4096))


class _Handler(http.server.BaseHTTPRequestHandler):
    files: dict[str, bytes] = {}

    def do_GET(self) -> None:  # noqa: N802
        if self.path.startswith("/endless/") and self.path.endswith(".safetensors"):
            self.send_response(200)
            self.end_headers()
            try:
                while True:  # no Content-Length, no end
                    self.wfile.write(b"\x00" * 65536)
            except (BrokenPipeError, ConnectionResetError):
                return
        if self.path.startswith("/redirect/"):
            self.send_response(302)
            self.send_header("Location", "http://example.invalid/x")
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        body = self.files.get(self.path)
        if body is None:
            self.send_error(404)
            return
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture()
def http_server() -> Iterator[str]:
    _Handler.files = {
        "/sql/adapter_config.json": CONFIG,
        "/sql/adapter_model.safetensors": WEIGHTS,
        "/sql/tokenizer.json": b"{}",  # optional files are fetched when the source has them
        "/endless/adapter_config.json": CONFIG,
        "/half/adapter_config.json": CONFIG,
    }
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def test_http_sources_from_allowed_hosts_with_limits(tmp_path: Path, http_server: str) -> None:
    policy = SourcePolicy(hosts=(http_server,), max_file_bytes=1 << 20)
    got = fetch(f"http://{http_server}/sql/", tmp_path / "ok", policy)
    assert (got / "adapter_config.json").read_bytes() == CONFIG
    assert (got / "adapter_model.safetensors").read_bytes() == WEIGHTS
    assert sorted(p.name for p in got.iterdir()) == [
        "adapter_config.json",
        "adapter_model.safetensors",
        "tokenizer.json",
    ]
    cases = {
        f"http://{http_server}/sql": None,  # fine without the trailing slash too
        f"http://localhost:{http_server.split(':')[1]}/sql": "not an allowed source host",
        f"http://user:pw@{http_server}/sql": "credentials",
        f"http://{http_server}/endless": "larger than the limit",  # stops at 1 MiB
        f"http://{http_server}/half": "not found",
        f"http://{http_server}/redirect": "fetch failed",
    }
    for i, (source, why) in enumerate(cases.items()):
        stage = tmp_path / f"stage-{i}"
        if why is None:
            fetch(source, stage, policy)
            continue
        with pytest.raises(SourceError, match=why):
            fetch(source, stage, policy)
        assert not (stage / "adapter_model.safetensors").exists(), source


@pytest.fixture()
def s3_server(monkeypatch) -> Iterator[str]:  # noqa: ANN001
    """A local S3-compatible server (moto's server mode) on 127.0.0.1, with fake credentials."""
    moto_server = pytest.importorskip("moto.server")
    pytest.importorskip("s3fs")
    for key, value in {
        "AWS_ACCESS_KEY_ID": "test",
        "AWS_SECRET_ACCESS_KEY": "test",
        "AWS_DEFAULT_REGION": "us-east-1",
    }.items():
        monkeypatch.setenv(key, value)
    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    try:
        yield f"http://{host}:{port}"
    finally:
        server.stop()


def test_s3_sources_from_allowed_buckets(tmp_path: Path, s3_server: str) -> None:
    import fsspec

    fs = fsspec.filesystem("s3", client_kwargs={"endpoint_url": s3_server}, skip_instance_cache=True)
    fs.mkdir("adapters")
    fs.pipe("adapters/sql/adapter_config.json", CONFIG)
    fs.pipe("adapters/sql/adapter_model.safetensors", WEIGHTS)
    fs.pipe("adapters/sql/loraplex.json", b'{"base_revision": "declared:x"}')
    fs.pipe("adapters/big/adapter_config.json", CONFIG)
    fs.pipe("adapters/big/adapter_model.safetensors", b"\x00" * (3 << 20))
    fs.mkdir("private")
    fs.pipe("private/sql/adapter_config.json", CONFIG)
    policy = SourcePolicy(buckets=("adapters",), s3_endpoint=s3_server, max_file_bytes=2 << 20)
    got = fetch("s3://adapters/sql", tmp_path / "ok", policy)
    assert (got / "adapter_model.safetensors").read_bytes() == WEIGHTS
    assert (got / "loraplex.json").is_file() and not (got / "tokenizer.json").exists()
    cases = {
        "s3://private/sql": "not an allowed source bucket",
        "s3://adapters/missing": "not found",
        "s3://adapters/big": "larger than the limit",
        "s3://adapters/sql/../big": "'..'",
    }
    for i, (source, why) in enumerate(cases.items()):
        stage = tmp_path / f"stage-{i}"
        with pytest.raises(SourceError, match=why):
            fetch(source, stage, policy)
        assert not any(p.is_file() for p in stage.rglob("*")), source
