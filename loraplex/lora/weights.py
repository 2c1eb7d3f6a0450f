"""Normalized adapter weights and the slot table the LoRA op reads them through.

Every adapter is stored at its own rank (never padded to a global maximum): one `LoRAPair`
(A: [r, d_in], B: [d_out, r], scale) per (layer, target) it adapts. The engine gives each
registered revision a *slot*; the LoRA op receives slot ids in the batch metadata and looks the
weights up here. Ranks and scales live with the weights rather than in the per-step metadata
because `rank_pattern` / `alpha_pattern` make them vary per module within one adapter.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from functools import cached_property
from typing import TYPE_CHECKING, NamedTuple

import torch

from loraplex.lora.layout import TARGET_GROUP

if TYPE_CHECKING:
    from loraplex.lora.packed import PackedLayout


@dataclass(frozen=True)
class LoRAPair:
    a: torch.Tensor  # [r, d_in]
    b: torch.Tensor  # [d_out, r]
    scale: float

    @property
    def rank(self) -> int:
        return int(self.a.shape[0])

    @property
    def nbytes(self) -> int:
        return self.a.numel() * self.a.element_size() + self.b.numel() * self.b.element_size()


class WeightFacts(NamedTuple):
    """What the engine reads of an adapter's weights besides the tensors (`AdapterWeights`)."""

    ranks: dict[tuple[int, str], int]  # (layer, target) -> rank
    max_rank: int
    nbytes: int
    groups: frozenset[tuple[int, str]]  # (layer, group) pairs with at least one adapted slice


def adapted_groups(keys: Iterable[tuple[int, str]]) -> frozenset[tuple[int, str]]:
    """The (layer, group) pairs that the (layer, target) `keys` adapt a slice of."""
    return frozenset((layer, TARGET_GROUP[t]) for layer, t in keys)


@dataclass(frozen=True)
class AdapterWeights:
    """One adapter in the execution layout: (layer index, target name) -> LoRAPair.

    Its facts (largest rank, bytes, groups covered) are computed once, on first use, and kept:
    the pairs never change after construction, and steps read the facts of every adapter they run.
    """

    pairs: Mapping[tuple[int, str], LoRAPair]
    # When set: the one 1-D buffer every tensor of `pairs` is a view into, laid out from its start
    # as `layout` says (`lora/packed.py`): the host tier's copies and the device pool's extents
    # carry both, so a load copies one span and fills the kernels' tables without looking at
    # hundreds of tensors.
    packed: torch.Tensor | None = field(default=None, compare=False, repr=False)
    layout: PackedLayout | None = field(default=None, compare=False, repr=False)

    @classmethod
    def with_facts(
        cls,
        pairs: Mapping[tuple[int, str], LoRAPair],
        facts: WeightFacts,
        packed: torch.Tensor | None = None,
        layout: PackedLayout | None = None,
    ) -> AdapterWeights:
        """Weights whose facts are known already: views laid out exactly like weights measured
        before (`lora/packed.py`), so a load does not walk hundreds of pairs again for numbers it
        has."""
        weights = cls(pairs, packed, layout)
        weights.__dict__.update(facts._asdict())  # where the cached properties below keep them
        return weights

    @cached_property
    def ranks(self) -> dict[tuple[int, str], int]:
        """(layer, target) -> rank."""
        return {k: p.rank for k, p in self.pairs.items()}

    @cached_property
    def max_rank(self) -> int:
        return max(self.ranks.values(), default=0)

    @cached_property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.pairs.values())

    @cached_property
    def groups(self) -> frozenset[tuple[int, str]]:
        """(layer, group) pairs in which this adapter adapts at least one slice."""
        return adapted_groups(self.pairs)

    def to(self, device: torch.device | str, dtype: torch.dtype) -> AdapterWeights:
        return AdapterWeights(
            {
                k: LoRAPair(p.a.to(device=device, dtype=dtype), p.b.to(device=device, dtype=dtype), p.scale)
                for k, p in self.pairs.items()
            }
        )


_LOG_KEPT = 4096  # slot changes a table remembers for `changed_since`


class LoRASlotTable:
    """slot -> adapter weights, as seen by the LoRA op.

    Slots are small integers handed out by the engine; a slot is only reassigned after the
    engine has released every request holding it, so a running request never sees its
    weights change underneath it.
    """

    def __init__(self, num_layers: int, dtype: torch.dtype | None = None, capacity: int = 0) -> None:
        self.num_layers = num_layers
        # What device-side copies are sized for before any adapter arrives: the weights' dtype
        # and the number of slots to hold without reallocating (a reallocation invalidates every
        # captured decode graph, so the engine sizes it for the adapters it expects up front).
        self.dtype = dtype
        self.capacity = capacity
        self._slots: dict[int, AdapterWeights] = {}
        # Bumped on every change, so device-side copies (pointer tables, CUDA-graph buffers) know
        # when to refresh without diffing.
        self.version = 0
        # the slots of the latest changes, oldest first: change i made version _log_start + i + 1
        self._log: list[int] = []
        self._log_start = 0

    def __contains__(self, slot: int) -> bool:
        return slot in self._slots

    def __len__(self) -> int:
        return len(self._slots)

    def set(self, slot: int, weights: AdapterWeights) -> None:
        self._slots[slot] = weights
        self._changed(slot)

    def clear(self, slot: int) -> None:
        if self._slots.pop(slot, None) is not None:
            self._changed(slot)

    def _changed(self, slot: int) -> None:
        self.version += 1
        self._log.append(slot)
        if len(self._log) > _LOG_KEPT:
            half = len(self._log) // 2
            del self._log[:half]
            self._log_start += half

    def changed_since(self, version: int) -> list[int] | None:
        """The slots changed after `version` (with repeats, oldest first), so a device-side copy
        refreshes just those; None when that is too long ago to tell (refresh everything)."""
        if not self._log_start <= version <= self.version:
            return None
        return self._log[version - self._log_start :]

    def items(self) -> list[tuple[int, AdapterWeights]]:
        return sorted(self._slots.items())

    def weights(self, slot: int) -> AdapterWeights:
        return self._slots[slot]

    def pair(self, slot: int, layer: int, target: str) -> LoRAPair | None:
        return self._slots[slot].pairs.get((layer, target))

    def groups_of(self, slot: int) -> frozenset[tuple[int, str]]:
        return self._slots[slot].groups
