"""Shared test setup: tiny tensors run many times faster on one thread."""

import pytest
import torch

torch.set_num_threads(1)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.fixture(autouse=True)
def _isolated_data_dir(monkeypatch: pytest.MonkeyPatch, tmp_path_factory: pytest.TempPathFactory) -> None:
    """`loraplex serve` and the offline CLI default to the per-user data directory: a test (and any
    server it starts as a subprocess) gets a fresh one instead of the user's own."""
    monkeypatch.setenv("LORAPLEX_DATA_DIR", str(tmp_path_factory.mktemp("loraplex-data")))
    monkeypatch.delenv("LORAPLEX_ADMIN_KEY", raising=False)
