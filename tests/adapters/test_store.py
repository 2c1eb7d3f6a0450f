"""The content-addressed store: a real PEFT adapter imported, stored and read back identical (same
revision, same tensors, an engine serving it gives the same tokens), atomic writes, and damaged
files refused."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers.tiny_models import build_hf_model, make_peft_adapter, save_hf_model

from loraplex import LLM, SamplingParams
from loraplex.adapters.peft_import import import_peft_adapter
from loraplex.adapters.revision import adapter_revision
from loraplex.adapters.store import AdapterStore, StoreError
from loraplex.config import ModelConfig


@pytest.fixture(scope="module")
def imported_case(tmp_path_factory):  # noqa: ANN001, ANN201
    root = tmp_path_factory.mktemp("store")
    hf = build_hf_model("llama", seed=3)
    model_dir = save_hf_model(hf, root / "model")
    adapter = make_peft_adapter(hf, root / "a", r=8, target_modules=["q_proj", "down_proj"], seed=4)
    imported = import_peft_adapter(adapter, ModelConfig.from_dir(model_dir), 64)
    return model_dir, imported


def test_round_trip_is_the_same_revision_and_the_same_outputs(tmp_path: Path, imported_case) -> None:  # noqa: ANN001
    model_dir, imported = imported_case
    revision = adapter_revision(imported)
    store = AdapterStore(tmp_path / "store")
    path = store.put(revision, imported)
    assert store.put(revision, imported) == path and store.revisions() == [revision]  # idempotent
    back = AdapterStore(tmp_path / "store").get(revision)  # a fresh store object, as after a restart
    assert back.manifest == imported.manifest
    for key, pair in imported.weights.pairs.items():
        assert torch.equal(back.weights.pairs[key].a, pair.a) and torch.equal(
            back.weights.pairs[key].b, pair.b
        )
        assert back.weights.pairs[key].scale == pair.scale
    outs = []
    for adapter in (imported, back):
        llm = LLM(model_dir)
        llm.engine.register_imported("a", adapter)
        outs.append(
            llm.generate([[5, 6, 7, 8]], SamplingParams(max_tokens=8, temperature=0, logprobs=1), "a")[0]
        )
    assert outs[0].token_ids == outs[1].token_ids and outs[0].logprobs == outs[1].logprobs


def test_damaged_files_and_wrong_keys_are_refused(tmp_path: Path, imported_case) -> None:  # noqa: ANN001
    _, imported = imported_case
    revision = adapter_revision(imported)
    store = AdapterStore(tmp_path / "store")
    with pytest.raises(StoreError, match="does not hash"):
        store.put("0" * 64, imported)
    assert store.revisions() == []  # nothing written for a refused put
    path = store.put(revision, imported)
    data = bytearray(path.read_bytes())
    data[-5] ^= 0xFF  # flip a bit of the last tensor's bytes
    path.write_bytes(bytes(data))
    with pytest.raises(StoreError, match="does not match its revision"):
        store.get(revision)
    path.write_bytes(bytes(data[: len(data) // 2]))  # truncated
    with pytest.raises(StoreError, match="unreadable"):
        store.get(revision)
    for bad in ("../../etc/passwd", "a" * 63, "g" * 64):
        with pytest.raises(StoreError, match="not a revision"):
            store.path(bad)
    with pytest.raises(StoreError, match="not in the store"):
        store.get("f" * 64)


def test_a_cut_short_write_leaves_no_file(tmp_path: Path, imported_case) -> None:  # noqa: ANN001
    _, imported = imported_case
    revision = adapter_revision(imported)
    shard = tmp_path / "store" / revision[:2]
    shard.mkdir(parents=True)
    (shard / f".tmp-{revision}-999").write_bytes(b"partial")
    store = AdapterStore(tmp_path / "store")  # opening sweeps what a crash left
    assert not list(shard.iterdir()) and revision not in store
