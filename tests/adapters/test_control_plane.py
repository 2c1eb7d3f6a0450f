"""Registering from a source as one transaction: a matrix of bad adapters, each refused with its
reason, with the registry rows, the store's files and the audit log checked before and after;
idempotent re-registration; identical content under two names stored once."""

from __future__ import annotations

import json
import pickle
from pathlib import Path

import pytest

pytest.importorskip("sqlalchemy")  # server-side packages: the GPU machine's image lacks them
pytest.importorskip("fsspec")

import torch  # noqa: E402
from helpers.tiny_models import build_hf_model, make_peft_adapter, save_hf_model  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402

from loraplex.adapters import registry_db as rdb  # noqa: E402
from loraplex.adapters.base_identity import directory_identity  # noqa: E402
from loraplex.adapters.control_plane import ControlPlane, RegistrationError  # noqa: E402
from loraplex.adapters.registry_db import RegistryDB  # noqa: E402
from loraplex.adapters.sources import SourcePolicy  # noqa: E402
from loraplex.adapters.store import AdapterStore  # noqa: E402
from loraplex.config import ModelConfig  # noqa: E402


class _Trap:
    """Unpickling this would create the file named in `path`."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):  # noqa: ANN204
        return (open, (self.path, "w"))


@pytest.fixture(scope="module")
def world(tmp_path_factory):  # noqa: ANN001, ANN201
    root = tmp_path_factory.mktemp("cp")
    hf = build_hf_model("llama", seed=7)
    model_dir = save_hf_model(hf, root / "model")
    sources = root / "sources"
    good = make_peft_adapter(hf, sources / "good", r=8, target_modules=["q_proj", "v_proj"], seed=1)
    make_peft_adapter(hf, sources / "big-rank", r=32, target_modules=["q_proj"], seed=2)
    make_peft_adapter(hf, sources / "dora", r=8, target_modules=["q_proj"], seed=3, use_dora=True)
    make_peft_adapter(
        hf, sources / "save", r=8, target_modules=["q_proj"], seed=4, modules_to_save=["lm_head"]
    )
    nan = make_peft_adapter(hf, sources / "nan", r=8, target_modules=["q_proj"], seed=5)
    tensors = load_file(str(nan / "adapter_model.safetensors"))
    first = sorted(tensors)[0]
    tensors[first] = tensors[first].clone()
    tensors[first][0, 0] = float("nan")
    save_file(tensors, str(nan / "adapter_model.safetensors"))
    wrong = make_peft_adapter(hf, sources / "targets", r=8, target_modules=["q_proj"], seed=6)
    config = json.loads((wrong / "adapter_config.json").read_text())
    config["target_modules"] = ["nonexistent_proj"]
    (wrong / "adapter_config.json").write_text(json.dumps(config))
    trunc = make_peft_adapter(hf, sources / "truncated", r=8, target_modules=["q_proj"], seed=8)
    data = (trunc / "adapter_model.safetensors").read_bytes()
    (trunc / "adapter_model.safetensors").write_bytes(data[: len(data) // 2])
    pickled = sources / "pickled"
    pickled.mkdir()
    (pickled / "adapter_config.json").write_text((good / "adapter_config.json").read_text())
    sentinel = root / "unpickled-ran"
    (pickled / "adapter_model.bin").write_bytes(pickle.dumps(_Trap(str(sentinel))))
    (root / "outside").mkdir()
    return root, model_dir, sources, good, sentinel


def _plane(root: Path, model_dir: Path, sources: Path, tag: str) -> ControlPlane:
    data = root / f"data-{tag}"
    return ControlPlane(
        RegistryDB.in_dir(str(data.mkdir(parents=True) or data)),
        AdapterStore(data / "store"),
        SourcePolicy(roots=(sources,)),
        ModelConfig.from_dir(model_dir),
        max_rank=16,
        staging_root=data / "staging",
        base=directory_identity(model_dir),
    )


def test_bad_adapters_change_nothing_and_are_audited(world) -> None:  # noqa: ANN001
    root, model_dir, sources, good, sentinel = world
    plane = _plane(root, model_dir, sources, "bad")
    plane.register("good", str(good), principal="ops")
    before = (plane.db.count(rdb.adapters), plane.store.revisions(), plane.db.count(rdb.audit_log))
    good_sha = "0" * 64
    cases = [
        ("pickled", str(sources / "pickled"), None, "adapter_model.safetensors"),
        ("truncated", str(sources / "truncated"), None, "not a valid safetensors file"),
        ("nan", str(sources / "nan"), None, "NaN"),
        ("dora", str(sources / "dora"), None, "DoRA"),
        ("save", str(sources / "save"), None, "modules_to_save"),
        ("targets", str(sources / "targets"), None, "nonexistent_proj' matches no module"),
        ("big-rank", str(sources / "big-rank"), None, "max_rank"),
        ("checksum", str(good), good_sha, "checksum mismatch"),
        ("traversal", str(sources / "good" / ".." / "good"), None, "'..'"),
        ("outside", str(root / "outside"), None, "outside the allowed source roots"),
        ("url", "http://example.com/adapter", None, "not an allowed source host"),
        ("bad/name", str(good), None, "invalid adapter name"),
    ]
    for name, source, sha, why in cases:
        with pytest.raises(RegistrationError, match=why) as refused:
            plane.register(name, source, principal="ops", sha256=sha)
        assert "staging" not in str(refused.value)  # the reason names the source, not a temp dir
    assert not sentinel.exists(), "a pickle was unpickled"
    assert plane.db.count(rdb.adapters) == before[0] and plane.store.revisions() == before[1]
    refusals = plane.db.audit(offset=before[2])
    assert len(refusals) == len(cases) and all(e["result"] == "refused" and e["reason"] for e in refusals)
    assert not list((root / "data-bad" / "staging").iterdir())  # staging cleaned after every attempt


def test_idempotent_and_content_addressed(world) -> None:  # noqa: ANN001
    root, model_dir, sources, good, _ = world
    plane = _plane(root, model_dir, sources, "ok")
    first = plane.register("sql", str(good), principal="ops")
    assert first.created and len(first.revision) == 64
    again = plane.register("sql", str(good), principal="ops")
    assert not again.created and again.revision == first.revision
    other = plane.register("support", str(good), principal="ops")  # same content, another name
    assert other.revision == first.revision and plane.store.revisions() == [first.revision]
    assert plane.db.count(rdb.adapters) == 2
    record = plane.db.resolve("sql")
    assert record.provenance["source"] == str(good) and record.provenance["principal"] == "ops"
    assert set(record.provenance["files"]) == {"adapter_config.json", "adapter_model.safetensors"}
    back = plane.store.get(first.revision)  # the store alone can serve it again
    assert torch.equal(next(iter(back.weights.pairs.values())).a, next(iter(back.weights.pairs.values())).a)
    assert back.manifest == first.manifest
