"""Linear layers in the execution layout, each with an online LoRA branch per slice.

Written column-/row-parallel with world size 1 so tensor parallelism can be added by sharding
weights at load time: a column-parallel layer owns a slice of the output features (LoRA B rows
follow it), a row-parallel layer a slice of the input features (LoRA A columns follow it, and
the partial outputs are summed after the LoRA add). The LoRA branch is never merged into the
base weights: the base GEMM runs over all rows, then the step's LoRA op adds each adapter's
low-rank product into exactly its own rows.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar, cast

import torch
import torch.nn.functional as F
from torch import nn

from loraplex.lora.backend import LoRABackend
from loraplex.lora.metadata import LoRABatchMetadata
from loraplex.lora.weights import LoRASlotTable

T = TypeVar("T")


@dataclass(frozen=True)
class LoRAStep:
    """What the LoRA branch needs for one forward: the step's metadata plus the engine's slot
    table and op backend (those two live as long as the engine)."""

    meta: LoRABatchMetadata
    table: LoRASlotTable
    backend: LoRABackend
    # Overlap: the LoRA op's first launch (H = X A^T, which needs only x) runs on `side_stream`
    # while the base GEMM computes y on the current stream; its second (y += s H B^T) follows
    # the GEMM (CUDA-graph decode steps, where the LoRA kernels are latency-bound). With overlap
    # set and no side stream, the same two halves run on one stream (CPU tests).
    overlap: bool = False
    side_stream: torch.cuda.Stream | None = None
    # Concurrent: where the caller gives a `lora_into` tensor, the whole LoRA op runs on
    # `side_stream` beside the GEMM and adds into that tensor, which the caller adds to y later
    # (GraphConfig.lora_overlap = 2). Without a side stream: the same on one stream.
    concurrent: bool = False

    @classmethod
    def begin(
        cls, meta: LoRABatchMetadata, table: LoRASlotTable, backend: LoRABackend, **options: Any
    ) -> LoRAStep:
        """The LoRA state of one forward, after the backend's per-step preparation (which a
        captured step records into its graph)."""
        backend.begin_step(meta, table, meta.row_perm.device)
        return cls(meta, table, backend, **options)


class _LoRALinear(nn.Module):
    """Base linear layer `y = x W^T (+ b)` of one (layer, group), plus its LoRA branch."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool,
        layer: int,
        group: str,
        slice_sizes: Sequence[int],
        dtype: torch.dtype,
    ) -> None:
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.layer = layer
        self.group = group
        self.slice_offsets = tuple(int(x) for x in torch.tensor([0, *slice_sizes]).cumsum(0).tolist())
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=dtype), requires_grad=False)
        self.bias = (
            nn.Parameter(torch.zeros(out_features, dtype=dtype), requires_grad=False) if bias else None
        )

    def forward(
        self,
        x: torch.Tensor,
        lora: LoRAStep | None,
        lora_into: torch.Tensor | None = None,
        zero_into: bool = False,
    ) -> torch.Tensor:
        """x: [T, d_in] -> y: [T, d_out]. lora_into ([T, d_out]): in a concurrent step, where the
        LoRA output goes instead of y (zeroed first if zero_into); the caller adds it to y."""
        if lora is None or not lora.meta.targets_group(self.layer, self.group):
            return F.linear(x, self.weight, self.bias)
        if lora.concurrent and lora_into is not None:
            return self._forward_concurrent(x, lora, lora_into, zero_into)
        if lora.overlap:
            return self._forward_overlapped(x, lora)
        y = F.linear(x, self.weight, self.bias)
        lora.backend.apply(y, x, lora.meta, lora.table, self.layer, self.group, self.slice_offsets)
        return y

    def _forward_overlapped(self, x: torch.Tensor, lora: LoRAStep) -> torch.Tensor:
        """The base GEMM and the LoRA shrink concurrently, then the expand into y (see LoRAStep).
        The shrink's scratch is freed on the side stream, whose next use waits for the main stream
        (at the next call), so the expand below has read it by then."""
        args = (lora.meta, lora.table, self.layer, self.group, self.slice_offsets)
        y, partial = self._gemm_beside(x, lora.side_stream, lambda: lora.backend.shrink(x, *args))
        if partial is not None:
            lora.backend.expand(y, partial)
        return y

    def _forward_concurrent(
        self, x: torch.Tensor, lora: LoRAStep, into: torch.Tensor, zero_into: bool
    ) -> torch.Tensor:
        """The base GEMM, and beside it the whole LoRA op adding into `into` (see LoRAStep)."""
        args = (lora.meta, lora.table, self.layer, self.group, self.slice_offsets)

        def lora_op() -> None:
            if zero_into:
                into.zero_()
            lora.backend.apply(into, x, *args)

        return self._gemm_beside(x, lora.side_stream, lora_op)[0]

    def _gemm_beside(
        self, x: torch.Tensor, side: torch.cuda.Stream | None, work: Callable[[], T]
    ) -> tuple[torch.Tensor, T]:
        """(the base GEMM's y, work()): `work` runs on `side` while the GEMM runs on the current
        stream, joined after it, so whatever the current stream does next sees both. Without a side
        stream, the same on one stream."""
        if side is None:
            out = work()
            return F.linear(x, self.weight, self.bias), out
        main = torch.cuda.current_stream(x.device)
        side.wait_stream(main)  # x and everything `work` reads are ready
        with torch.cuda.stream(side):
            out = work()
        y = F.linear(x, self.weight, self.bias)
        main.wait_stream(side)
        return y, out

    def load_slice(self, index: int, tensor: torch.Tensor, bias: bool = False) -> None:
        """Copy one logical projection (a fused slice) from a checkpoint tensor."""
        lo, hi = self.slice_offsets[index], self.slice_offsets[index + 1]
        # bias=True on a layer made without a bias fails here: None is not subscriptable
        dest = cast(nn.Parameter, self.bias if bias else self.weight)[lo:hi]
        if tuple(dest.shape) != tuple(tensor.shape):
            raise ValueError(
                f"checkpoint tensor for layer {self.layer} {self.group}[{index}] has shape "
                f"{tuple(tensor.shape)}, expected {tuple(dest.shape)}"
            )
        dest.copy_(tensor)


class ColumnParallelLinear(_LoRALinear):
    """Output features sharded across ranks (world size 1 for now); optionally several fused
    slices (q/k/v, gate/up) along the output dimension."""


class RowParallelLinear(_LoRALinear):
    """Input features sharded across ranks; with world size > 1 the outputs are all-reduced after
    the LoRA add, so each rank adds the LoRA partial of its own input shard."""
