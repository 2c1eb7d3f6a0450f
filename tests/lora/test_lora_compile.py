"""The LoRA kernels compile for sm_90 (the compiler, not only the interpreter, accepts them)."""

from __future__ import annotations

import pytest
from helpers.sm90 import can_compile_sm90, run_compile_script


@pytest.mark.skipif(not can_compile_sm90(), reason="needs triton with its NVIDIA backend (ptxas)")
def test_lora_kernels_compile_for_sm90() -> None:
    run_compile_script("lora.sm90_compile_lora")
