"""Backend choice per device, and the promise that CPU-only installs never need triton."""

from __future__ import annotations

import subprocess
import sys

import torch

from loraplex.lora.backend import make_lora_backend
from loraplex.lora.ops_torch import TorchLoRABackend
from loraplex.lora.triton_config import DECODE, PREFILL, block_r_for, pick_tiling, split_k


def test_cpu_gets_the_torch_reference() -> None:
    assert isinstance(make_lora_backend(torch.device("cpu")), TorchLoRABackend)


def test_lora_package_imports_without_triton() -> None:
    code = (
        "import sys; sys.modules['triton'] = None\n"  # any `import triton` now raises ImportError
        "import loraplex.lora, loraplex.lora.backend, loraplex.lora.ops_torch\n"
        "import loraplex.lora.triton_config, loraplex.lora.triton_table, loraplex.lora.ops_triton\n"
        "import loraplex.bench.workloads, loraplex.bench.cli\n"
        "from loraplex.lora.backend import make_lora_backend\n"
        "assert make_lora_backend('cpu').name == 'torch'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_tiling_choice_and_split() -> None:
    assert pick_tiling(1) is DECODE and pick_tiling(2) is DECODE
    assert pick_tiling(4096) is PREFILL
    assert [block_r_for(r) for r in (1, 8, 16, 17, 64)] == [16, 16, 16, 32, 64]
    s = split_k(DECODE, 4096, programs=32, num_sms=132)  # 32 decode segments: split K 8 ways
    assert s.n_split == 8 and s.k_chunk * s.n_split >= 4096 and s.k_chunk % DECODE.block_k == 0
    assert split_k(PREFILL, 4096, programs=512, num_sms=132).n_split == 1  # enough row tiles
    s = split_k(DECODE, 14336, programs=1, num_sms=132)
    assert s.n_split == DECODE.max_split and (s.n_split - 1) * s.k_chunk < 14336
