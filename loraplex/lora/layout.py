"""How LoRA targets map onto the execution layout (fused qkv and gate_up projections).

A *target* is one logical projection of the base model (q, k, v, o, gate, up, down). A *group* is
one executed linear layer; the fused ones carry several targets as output slices.
"""

from __future__ import annotations

TARGETS: tuple[str, ...] = ("q", "k", "v", "o", "gate", "up", "down")

GROUP_SLICES: dict[str, tuple[str, ...]] = {
    "qkv": ("q", "k", "v"),
    "o": ("o",),
    "gate_up": ("gate", "up"),
    "down": ("down",),
}

TARGET_GROUP: dict[str, str] = {t: g for g, ts in GROUP_SLICES.items() for t in ts}

TARGET_INDEX: dict[str, int] = {t: i for i, t in enumerate(TARGETS)}


def pair_row(layer: int, target: str) -> int:
    """Row of (layer, target) in the kernels' per-slot tables (`lora/triton_table.py`), and its bit
    in a slot's coverage mask."""
    return layer * len(TARGETS) + TARGET_INDEX[target]


# Hugging Face module names of each target inside a decoder layer.
HF_MODULE_NAMES: dict[str, str] = {
    "q": "self_attn.q_proj",
    "k": "self_attn.k_proj",
    "v": "self_attn.v_proj",
    "o": "self_attn.o_proj",
    "gate": "mlp.gate_proj",
    "up": "mlp.up_proj",
    "down": "mlp.down_proj",
}
