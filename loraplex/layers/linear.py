"""Linear layers in the execution layout, each with an online LoRA branch per slice.

Written column-/row-parallel with world size 1 so tensor parallelism can be added by sharding
weights at load time: a column-parallel layer owns a slice of the output features (LoRA B rows
follow it), a row-parallel layer a slice of the input features (LoRA A columns follow it, and
the partial outputs are summed after the LoRA add). The LoRA branch is never merged into the
base weights: the base GEMM runs over all rows, then the step's LoRA op adds each adapter's
low-rank product into exactly its own rows.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import cast

import torch
import torch.nn.functional as F
from torch import nn

from loraplex.lora.step import LoRAContext


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
        self, x: torch.Tensor, lora: LoRAContext | None, residual: torch.Tensor | None = None
    ) -> torch.Tensor:
        """x: [T, d_in] -> y: [T, d_out]. residual: the tensor y is added to next, if the caller
        adds it to one; the step's LoRA op may add its part there instead of into y."""
        if lora is None or not lora.adapts(self.layer, self.group):
            return self._base(x)
        return lora.project(x, self._base, self.layer, self.group, self.slice_offsets, residual)

    def forward_deferred(
        self, x: torch.Tensor, lora: LoRAContext | None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(y, delta): delta, when not None, is a LoRA output the caller adds to y itself (the
        activation that reads y fuses the add)."""
        if lora is None or not lora.adapts(self.layer, self.group):
            return self._base(x), None
        return lora.project_deferred(x, self._base, self.layer, self.group, self.slice_offsets)

    def _base(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)

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
