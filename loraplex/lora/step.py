"""The LoRA state of one forward, as the model sees it: one object per step, one call per projection.

The model's layers call `LoRAContext.project` (or `project_deferred`) with their base GEMM, their
(layer, group) and slice offsets; they know nothing of kernels, tilings, row packing or where the
LoRA op runs. The context decides the schedule from the step:

- an eager step (the metadata of this step's rows): the base GEMM, then the LoRA op adding into
  its output, on the current stream;
- a static step (a captured decode step or its eager twin, `meta.static` set): the LoRA op runs
  on a side stream beside the base GEMM and adds into a tensor the GEMM's consumer adds anyway —
  the residual stream for o and down, a delta buffer for gate_up that the activation adds — so no
  extra kernel is needed; qkv stays in place (RoPE and the KV write take no delta). Measured on an
  H200 below in place in every same-run pair (`docs/cuda-graphs.md`). Without CUDA (the CPU tests
  of the static path) the same arithmetic runs on one stream.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from loraplex.lora.backend import LoRABackend
from loraplex.lora.metadata import LoRABatchMetadata
from loraplex.lora.weights import LoRASlotTable

BaseGemm = Callable[[torch.Tensor], torch.Tensor]

_side_streams: dict[torch.device, torch.cuda.Stream] = {}  # one per device, made on first use


def _side_stream(device: torch.device) -> torch.cuda.Stream | None:
    if device.type != "cuda":
        return None
    if device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    stream = _side_streams.get(device)
    if stream is None:
        stream = _side_streams[device] = torch.cuda.Stream(device)
    return stream


@dataclass(frozen=True)
class LoRAContext:
    meta: LoRABatchMetadata
    table: LoRASlotTable
    backend: LoRABackend
    beside: bool  # the LoRA op runs beside the base GEMM, into the consumer's tensor
    side_stream: torch.cuda.Stream | None

    @classmethod
    def begin(cls, meta: LoRABatchMetadata, table: LoRASlotTable, backend: LoRABackend) -> LoRAContext:
        """After the backend's per-step preparation (which a captured step records into its graph)."""
        device = meta.row_perm.device
        backend.begin_step(meta, table, device)
        beside = meta.static is not None
        return cls(meta, table, backend, beside, _side_stream(device) if beside else None)

    def adapts(self, layer: int, group: str) -> bool:
        return self.meta.targets_group(layer, group)

    def project(
        self,
        x: torch.Tensor,
        base: BaseGemm,
        layer: int,
        group: str,
        slice_offsets: Sequence[int],
        residual: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """base(x) with the LoRA output added; given `residual` (the tensor the result is added to
        next), the LoRA output may go into it instead of into the result."""
        if self.beside and residual is not None:
            into = residual
            return self._beside(x, base, lambda: self._apply(into, x, layer, group, slice_offsets))
        y = base(x)
        self._apply(y, x, layer, group, slice_offsets)
        return y

    def project_deferred(
        self, x: torch.Tensor, base: BaseGemm, layer: int, group: str, slice_offsets: Sequence[int]
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(y, delta): delta, when not None, is the LoRA output the consumer must still add to y."""
        if not self.beside:
            return self.project(x, base, layer, group, slice_offsets), None
        delta = torch.empty(x.shape[0], slice_offsets[-1], dtype=x.dtype, device=x.device)

        def lora_op() -> None:
            delta.zero_()
            self._apply(delta, x, layer, group, slice_offsets)

        return self._beside(x, base, lora_op), delta

    def _apply(
        self, y: torch.Tensor, x: torch.Tensor, layer: int, group: str, slice_offsets: Sequence[int]
    ) -> None:
        self.backend.apply(y, x, self.meta, self.table, layer, group, slice_offsets)

    def _beside(self, x: torch.Tensor, base: BaseGemm, lora_op: Callable[[], None]) -> torch.Tensor:
        """base(x) on the current stream with `lora_op` on the side stream, joined after the GEMM,
        so whatever the current stream does next sees both."""
        side = self.side_stream
        if side is None:
            lora_op()
            return base(x)
        main = torch.cuda.current_stream(x.device)
        side.wait_stream(main)  # x and everything the LoRA op reads are ready
        with torch.cuda.stream(side):
            lora_op()
        y = base(x)
        main.wait_stream(side)
        return y
