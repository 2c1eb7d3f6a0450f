"""Pick the LoRA backend for a device: Triton kernels on CUDA, the torch reference elsewhere."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch

from loraplex.lora.metadata import LoRABatchMetadata
from loraplex.lora.ops_torch import TorchLoRABackend
from loraplex.lora.weights import LoRASlotTable


class LoRABackend(Protocol):
    """The LoRA op as the model's linear layers call it (contract: `ops_torch.py`)."""

    name: str

    @property
    def total_calls(self) -> int: ...

    def graph_epoch(self, table: LoRASlotTable, device: torch.device | str) -> tuple[int, int]: ...

    # once per forward, before its first `apply` (inside the capture of a captured step);
    # replayed: whether the step's calls run as CUDA-graph replays (None: a step with static
    # metadata, or one being captured)
    def begin_step(
        self,
        meta: LoRABatchMetadata,
        table: LoRASlotTable,
        device: torch.device | str,
        replayed: bool | None = None,
    ) -> None: ...

    def apply(
        self,
        y: torch.Tensor,
        x: torch.Tensor,
        meta: LoRABatchMetadata,
        table: LoRASlotTable,
        layer: int,
        group: str,
        slice_offsets: Sequence[int],
    ) -> None: ...


def make_lora_backend(device: torch.device | str) -> LoRABackend:
    """Triton on CUDA (imported only here, so CPU-only installs never need it); torch otherwise."""
    if torch.device(device).type == "cuda":
        from loraplex.lora.ops_triton import TritonLoRABackend

        return TritonLoRABackend()
    return TorchLoRABackend()
