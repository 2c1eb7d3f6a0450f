"""Pick the LoRA backend for a device: Triton kernels on CUDA, the torch reference elsewhere."""

from __future__ import annotations

from typing import Protocol

import torch

from loraplex.lora.ops_torch import TorchLoRABackend


class LoRABackend(Protocol):
    name: str

    def apply(self, y, x, meta, table, layer, group, slice_offsets) -> None: ...  # noqa: ANN001


def make_lora_backend(device: torch.device | str) -> LoRABackend:
    """Triton on CUDA (imported only here, so CPU-only installs never need it); torch otherwise."""
    if torch.device(device).type == "cuda":
        from loraplex.lora.ops_triton import TritonLoRABackend

        return TritonLoRABackend()
    return TorchLoRABackend()
