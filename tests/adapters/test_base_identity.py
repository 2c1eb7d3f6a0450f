"""The served base's identity: a hash of its config and weights cached by file stat, a declared
revision for in-process models, the vocabulary hash, and adapters for another base or vocabulary
refused (in process, and not served at a server's startup)."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from loraplex.adapters import base_identity
from loraplex.adapters.base_identity import (
    BaseIdentity,
    declared_identity,
    directory_identity,
    tokenizer_vocab_hash,
)
from loraplex.adapters.control_plane import ControlPlane
from loraplex.adapters.registry_db import RegistryDB
from loraplex.adapters.sources import SourcePolicy
from loraplex.adapters.store import AdapterStore
from loraplex.config import EngineConfig, LoRAConfig, ModelConfig
from loraplex.demo import DEMO_ADAPTERS, DEMO_MODEL_DIR
from loraplex.server.control import BASE_CACHE
from loraplex.server.serve import ServerSettings, build_server

MODEL = str(DEMO_MODEL_DIR)


def _counting(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    calls = [0]
    real = base_identity.hash_files

    def counted(files):  # noqa: ANN001, ANN202
        calls[0] += 1
        return real(files)

    monkeypatch.setattr(base_identity, "hash_files", counted)
    return calls


def test_stat_cache_hashes_once_until_a_file_changes(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    model = tmp_path / "model"
    shutil.copytree(MODEL, model)
    cache = tmp_path / "data" / BASE_CACHE
    calls = _counting(monkeypatch)
    first = directory_identity(model, cache)
    assert calls[0] == 1 and first.revision.startswith("sha256:") and first.model_id == "model"
    assert directory_identity(model, cache) == first and calls[0] == 1  # from the cache
    assert directory_identity(model, None) == first and calls[0] == 2  # no cache: hashed
    weights = model / "model.safetensors"
    st = weights.stat()
    os.utime(weights, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000))  # touched: hashed again
    assert directory_identity(model, cache).revision == first.revision and calls[0] == 3
    data = bytearray(weights.read_bytes())
    data[-1] ^= 1
    weights.write_bytes(bytes(data))  # other weights: another revision
    assert directory_identity(model, cache).revision != first.revision and calls[0] == 4
    cache.write_text("not json")  # a damaged cache costs a rehash, never a failure
    assert directory_identity(model, cache).revision != first.revision and calls[0] == 5


def test_a_second_server_startup_does_not_rehash(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    calls = _counting(monkeypatch)
    for _ in range(2):
        settings = ServerSettings(model=MODEL, data_dir=str(tmp_path / "data"))
        build_server(settings, EngineConfig(model_dir=MODEL), progress=False).control.close()
    assert calls[0] == 1
    assert json.loads((tmp_path / "data" / BASE_CACHE).read_text())


def test_vocab_hash_is_the_vocabulary_only(tmp_path: Path) -> None:
    raw = json.loads((DEMO_MODEL_DIR / "tokenizer.json").read_text())
    base = tokenizer_vocab_hash(DEMO_MODEL_DIR / "tokenizer.json")
    raw["normalizer"] = None  # how text splits, not which id is which token
    (tmp_path / "tokenizer.json").write_text(json.dumps(raw))
    assert tokenizer_vocab_hash(tmp_path / "tokenizer.json") == base
    token = next(iter(raw["model"]["vocab"]))
    raw["model"]["vocab"][token] += 1000
    (tmp_path / "tokenizer.json").write_text(json.dumps(raw))
    assert tokenizer_vocab_hash(tmp_path / "tokenizer.json") != base
    (tmp_path / "tokenizer.json").write_text("[1, 2]")
    with pytest.raises(ValueError, match="no model vocabulary"):
        tokenizer_vocab_hash(tmp_path / "tokenizer.json")


def test_declared_revisions() -> None:
    assert declared_identity("m", "seed-0").revision == "declared:seed-0"
    assert declared_identity("m", "declared:x").revision == "declared:x"
    with pytest.raises(ValueError, match="non-empty"):
        declared_identity("m", "")


def test_in_process_model_has_a_declared_revision() -> None:
    import torch

    from loraplex.engine.engine import Engine
    from loraplex.model.loader import load_model

    config = EngineConfig(model_dir=MODEL)
    model = load_model(MODEL, torch.float32, torch.device("cpu"))
    default = Engine(config, model=model).base
    assert default.revision.startswith("declared:config-") and default.vocab_hash is None
    declared = Engine(config, model=model, base_revision="bench-seed-7")
    assert declared.base.revision == "declared:bench-seed-7"
    ref = declared.register_adapter("upper", DEMO_ADAPTERS["upper"])
    manifest = declared.adapters.list()[0].manifest
    assert manifest["base_revision"] == "declared:bench-seed-7"
    assert ref.revision != Engine(config).register_adapter("upper", DEMO_ADAPTERS["upper"]).revision
    with pytest.raises(ValueError, match="only with an in-process model"):
        Engine(config, base_revision="x")


def test_engine_refuses_another_base(tmp_path: Path) -> None:
    from loraplex.engine.engine import Engine

    engine = Engine(EngineConfig(model_dir=MODEL))
    other = tmp_path / "other"
    shutil.copytree(DEMO_ADAPTERS["upper"], other)
    (other / "loraplex.json").write_text(json.dumps({"base_revision": "sha256:" + "1" * 64}))
    with pytest.raises(ValueError, match="base model mismatch"):
        engine.register_adapter("other", other)
    shutil.copy(DEMO_MODEL_DIR / "tokenizer.json", other / "tokenizer.json")
    (other / "loraplex.json").write_text(json.dumps({"base_revision": engine.base.revision}))
    ref = engine.register_adapter("other", other)  # the base's revision and vocabulary: accepted
    assert [e.ref for e in engine.adapters.list()] == [ref]


def test_startup_skips_revisions_made_for_another_base(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A revision recorded for another base is neither served nor fatal, nor is an alias to it;
    its record stays (a server of its base may serve it)."""
    data = tmp_path / "data"
    data.mkdir()
    db = RegistryDB.in_dir(str(data))
    plane = ControlPlane(
        db,
        AdapterStore(data / "store"),
        SourcePolicy(roots=(DEMO_ADAPTERS["upper"].parent,)),
        ModelConfig.from_dir(MODEL),
        LoRAConfig().max_rank,
        data / "staging",
        BaseIdentity("elsewhere", "declared:another-base", None),
    )
    alien = plane.register("alien", str(DEMO_ADAPTERS["upper"]), "test", visibility="shared")
    db.set_alias("alien/latest", "alien", alien.revision, "test")
    db.close()
    upper = {"upper": str(DEMO_ADAPTERS["upper"])}
    settings = ServerSettings(model=MODEL, adapters=upper, data_dir=str(data))
    server = build_server(settings, EngineConfig(model_dir=MODEL), progress=False)
    try:
        served = {e.ref.name for e in server.async_engine.engine.adapters.list()}
        assert served == {"upper"}
        assert "alien/latest" not in server.async_engine.engine.adapters.aliases()
        assert server.control.db.get("alien", alien.revision) is not None
    finally:
        server.control.close()
    assert f"not serving alien@{alien.revision[:12]}" in capsys.readouterr().err
