"""`python -m loraplex.bench.lora_host`: host time per LoRA apply with the launches stubbed."""

from __future__ import annotations

import importlib.util

import pytest

from loraplex.bench.lora_host import main, measure

# Not importorskip: importing triton here, before the interpreter tests set TRITON_INTERPRET,
# would fix triton's mode for the whole run (this bench never launches a kernel either way).
pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton")


def test_lora_host_times_every_layer_and_group(capsys) -> None:  # noqa: ANN001
    assert measure(layers=2, rows=8, adapters=3, steps=2) > 0
    main(["--layers", "1", "--rows", "4", "--adapters", "2", "--steps", "1"])
    assert "host time per LoRA apply" in capsys.readouterr().out
