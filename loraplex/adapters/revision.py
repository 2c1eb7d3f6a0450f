"""Content identity of an imported adapter: sha256 over its normalized manifest and weights.

Two imports of the same content give the same revision wherever the files lie and whatever they are
named; any change to a weight, a rank, a scale or the targeted modules gives a new one. KV/prefix
hashes, device slots and metrics key on this string, never on the adapter's name.

The manifest's base revision and tokenizer hash are content (the same weights on another base
are another adapter); the base model's id is not (it names where the base was found), so it is
left out of the hash.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

import torch

from loraplex.adapters.peft_import import ImportedAdapter


def canonical_manifest_bytes(manifest: dict[str, Any]) -> bytes:
    """The manifest as canonical JSON: sorted keys, no whitespace, ASCII, no NaN/Infinity."""
    text = json.dumps(manifest, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False)
    return text.encode("ascii")


# Manifest fields that describe, not define, the content.
_UNHASHED_FIELDS = ("base_model_id",)


def adapter_revision(imported: ImportedAdapter) -> str:
    """sha256 hex of the canonical manifest (less `_UNHASHED_FIELDS`) followed by every A then B
    tensor as little-endian float32 bytes, in sorted (layer, target) order."""
    _check_manifest_matches_weights(imported)
    hashed = {k: v for k, v in imported.manifest.items() if k not in _UNHASHED_FIELDS}
    digest = hashlib.sha256(canonical_manifest_bytes(hashed))
    pairs = imported.weights.pairs
    for key in sorted(pairs):
        digest.update(_float32_bytes(pairs[key].a))
        digest.update(_float32_bytes(pairs[key].b))
    return digest.hexdigest()


def _float32_bytes(tensor: torch.Tensor) -> bytes:
    array = tensor.detach().to(device="cpu", dtype=torch.float32).contiguous().numpy()
    return array.astype("<f4", copy=False).tobytes()


def _check_manifest_matches_weights(imported: ImportedAdapter) -> None:
    # The tensor bytes are hashed without framing; the manifest's module list (keys, shapes) is what
    # makes the byte stream unambiguous, so it must describe exactly these tensors.
    described = {
        (m["layer"], m["target"]): (tuple(m["a_shape"]), tuple(m["b_shape"]))
        for m in imported.manifest.get("modules", [])
    }
    actual = {k: (tuple(p.a.shape), tuple(p.b.shape)) for k, p in imported.weights.pairs.items()}
    if described != actual:
        raise ValueError("adapter manifest does not describe its weights (modules or shapes differ)")
