"""Bad adapters through the admin API while generation runs: each a 4xx naming the problem, the
registry rows and the store's files unchanged, a pickle never unpickled, and the concurrent demo
traffic answered exactly right throughout; concurrent registrations of one name make one row."""

from __future__ import annotations

import json
import os
import pickle
import shutil
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from helpers.admin_server import MODEL, admin, admin_server, demo_traffic
from safetensors.torch import load_file, save_file

from loraplex.adapters.registry_db import adapters

WEIGHTS, CONFIG = "adapter_model.safetensors", "adapter_config.json"


class _Trap:
    """Unpickling this would create the file named in `path`."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):  # noqa: ANN204
        return (open, (self.path, "w"))


def _variant(root: Path, name: str, config: dict | None = None) -> Path:
    """A copy of the demo's 'reverse' adapter under `root`, its config changed by `config`."""
    path = root / name
    shutil.copytree(root / "reverse", path)
    if config is not None:
        cfg = json.loads((path / CONFIG).read_text())
        (path / CONFIG).write_text(json.dumps(cfg | config))
    return path


def _bad_adapters(root: Path, outside: Path, sentinel: Path) -> list[tuple[str, str, str]]:
    """(name, source, what the refusal must say) for each bad case."""
    pickled = _variant(root, "pickled")
    (pickled / WEIGHTS).unlink()
    (pickled / "adapter_model.bin").write_bytes(pickle.dumps(_Trap(str(sentinel))))
    truncated = _variant(root, "truncated")
    data = (truncated / WEIGHTS).read_bytes()
    (truncated / WEIGHTS).write_bytes(data[: len(data) // 2])
    nan, shapes = _variant(root, "nan"), _variant(root, "shapes")
    for path, damage in ((nan, "nan"), (shapes, "shape")):
        tensors = load_file(str(path / WEIGHTS))
        key = sorted(tensors)[0]
        if damage == "nan":
            tensors[key] = tensors[key].clone()
            tensors[key][0, 0] = float("nan")
        else:
            tensors[key] = tensors[key][:, :-1].clone()
        save_file(tensors, str(path / WEIGHTS))
    _variant(root, "dora", {"use_dora": True})
    _variant(root, "save", {"modules_to_save": ["lm_head"]})
    _variant(root, "targets", {"target_modules": ["nonexistent_proj"]})
    _variant(root, "rank", {"r": 4096, "lora_alpha": 8})
    shutil.copytree(root / "reverse", outside / "escaped")
    os.symlink(outside / "escaped", root / "link")
    other_base = _variant(root, "other-base")
    (other_base / "loraplex.json").write_text(json.dumps({"base_revision": "sha256:" + "0" * 64}))
    vocab = json.loads((Path(MODEL) / "tokenizer.json").read_text())
    first = next(iter(vocab["model"]["vocab"]))
    vocab["model"]["vocab"]["renamed-token"] = vocab["model"]["vocab"].pop(first)
    (_variant(root, "other-vocab") / "tokenizer.json").write_text(json.dumps(vocab))
    (_variant(root, "bare-vocab") / "vocab.json").write_text("{}")
    return [
        ("pickled", str(pickled), WEIGHTS),
        ("truncated", str(truncated), "not a valid safetensors file"),
        ("nan", str(nan), "NaN"),
        ("shapes", str(shapes), "shape"),
        ("dora", str(root / "dora"), "DoRA"),
        ("save", str(root / "save"), "modules_to_save"),
        ("targets", str(root / "targets"), "nonexistent_proj"),
        ("rank", str(root / "rank"), "4096"),
        ("link", str(root / "link"), "outside the allowed source roots"),
        ("abs", str(outside / "escaped"), "outside the allowed source roots"),
        ("dots", str(root / "reverse" / ".." / "upper"), "'..'"),
        ("url", "http://203.0.113.9/adapter", "not an allowed source host"),
        ("s3", "s3://bucket/adapter", "not an allowed"),
        ("bad@name", str(root / "upper"), "invalid adapter name"),
        ("other-base", str(other_base), "base model mismatch"),
        ("other-vocab", str(root / "other-vocab"), "tokenizer mismatch"),
        ("bare-vocab", str(root / "bare-vocab"), "no tokenizer.json"),
    ]


def test_bad_adapters_refused_while_generation_runs(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    outside, sentinel = tmp_path / "outside", tmp_path / "unpickled-ran"
    outside.mkdir()
    with admin_server(monkeypatch, tmp_path) as (base, server, root):
        cases = _bad_adapters(root, outside, sentinel)
        db, store = server.control.db, server.control.store
        before = (db.count(adapters), store.revisions())
        with demo_traffic(base) as wrong:
            for name, source, why in cases:
                out = admin("POST", base, "/adapters", json={"name": name, "source": source})
                assert 400 <= out.status_code < 500, (name, out.text)
                message = out.json()["error"]["message"]
                assert why in message and "staging" not in message, (name, message)
        assert not wrong, wrong[:3]
        assert not sentinel.exists(), "a pickle was unpickled"
        assert (db.count(adapters), store.revisions()) == before
        refused = [e for e in db.audit(limit=1000) if e["result"] == "refused"]
        assert len(refused) == len(cases)


def test_concurrent_registration_of_one_name(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    with admin_server(monkeypatch, tmp_path) as (base, server, root):
        before = server.control.db.count(adapters)
        body = {"name": "same", "source": str(root / "sort")}
        with ThreadPoolExecutor(4) as pool:
            answers = list(pool.map(lambda _: admin("POST", base, "/adapters", json=body), range(4)))
        assert sorted(a.status_code for a in answers) == [200, 200, 200, 201]
        assert len({a.json()["revision"] for a in answers}) == 1
        assert server.control.db.count(adapters) == before + 1


def test_adapter_shipping_the_base_tokenizer_and_revision_registers(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """The same vocabulary and the served base revision pass; the manifest records the base (its
    id, revision and vocabulary hash), and the revision is the plain adapter's (the tokenizer file
    and loraplex.json are provenance, not content)."""
    with admin_server(monkeypatch, tmp_path) as (base, server, root):
        ident = server.control.base
        shipped = _variant(root, "shipped")
        shutil.copy(Path(MODEL) / "tokenizer.json", shipped / "tokenizer.json")
        (shipped / "loraplex.json").write_text(json.dumps({"base_revision": ident.revision}))
        out = admin("POST", base, "/adapters", json={"name": "shipped", "source": str(shipped)})
        assert out.status_code == 201, out.text
        manifest = out.json()["manifest"]
        assert manifest["base_revision"] == ident.revision and ident.revision.startswith("sha256:")
        assert manifest["tokenizer_hash"] == ident.vocab_hash and manifest["base_model_id"]
        assert "tokenizer.json" in out.json()["provenance"]["files"]
        reverse = next(r for r in server.control.db.list_adapters() if r.name == "reverse")
        assert out.json()["revision"] == reverse.revision
