"""Pick the LoRA op backend for a device: Triton kernels on CUDA, the torch reference elsewhere."""

from __future__ import annotations

import torch

from loraplex.lora.ops_torch import TorchLoRABackend


def make_lora_backend(device: torch.device):  # noqa: ANN201 (either backend class)
    if device.type == "cuda":
        # Imported here so the package imports on machines without triton.
        from loraplex.lora.ops_triton import TritonLoRABackend

        return TritonLoRABackend()
    return TorchLoRABackend()
