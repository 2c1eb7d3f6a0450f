"""The content-addressed adapter store: execution-layout weights as safetensors, one file per
revision, under the data directory. It is the disk tier residency loads from, so a restarted
server serves every registered adapter without its original source.

Writes are atomic (a temporary file in the same directory, flushed, then renamed over the final
name), so a crash leaves either the whole file or none. Reads are checked against the key itself:
the loaded content's revision is computed again and must equal the revision it was stored under.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from loraplex.adapters.peft_import import ImportedAdapter
from loraplex.adapters.revision import adapter_revision, canonical_manifest_bytes
from loraplex.lora.weights import AdapterWeights, LoRAPair

STORE_FORMAT = "loraplex-store-1"


class StoreError(ValueError):
    """A stored adapter is missing or does not match its revision."""


class AdapterStore:
    def __init__(self, root: str | Path, clean: bool = True) -> None:
        """`clean`: remove what writes cut short by a crash left (the writer's own store; not a
        registration worker's view of it)."""
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        for stale in self.root.glob("*/.tmp-*") if clean else ():
            stale.unlink(missing_ok=True)

    def path(self, revision: str) -> Path:
        if len(revision) != 64 or any(c not in "0123456789abcdef" for c in revision):
            raise StoreError(f"not a revision: {revision!r}")
        return self.root / revision[:2] / f"{revision}.safetensors"

    def __contains__(self, revision: str) -> bool:
        return self.path(revision).is_file()

    def revisions(self) -> list[str]:
        return sorted(p.stem for p in self.root.glob("*/*.safetensors"))

    def put(self, revision: str, imported: ImportedAdapter) -> Path:
        """Store `imported` under `revision` (which must be its revision); a no-op when present."""
        if adapter_revision(imported) != revision:
            raise StoreError(f"content does not hash to revision {revision[:12]}")
        final = self.path(revision)
        if final.is_file():
            return final
        final.parent.mkdir(parents=True, exist_ok=True)
        tensors = {}
        for (layer, target), pair in imported.weights.pairs.items():
            tensors[f"{layer}.{target}.a"] = pair.a.detach().to("cpu", torch.float32).contiguous()
            tensors[f"{layer}.{target}.b"] = pair.b.detach().to("cpu", torch.float32).contiguous()
        meta = {"format": STORE_FORMAT, "manifest": canonical_manifest_bytes(imported.manifest).decode()}
        temp = final.parent / f".tmp-{revision}-{os.getpid()}"
        try:
            save_file(tensors, str(temp), metadata=meta)
            with open(temp, "rb") as f:
                os.fsync(f.fileno())
            os.replace(temp, final)
        finally:
            temp.unlink(missing_ok=True)
        return final

    def get(self, revision: str) -> ImportedAdapter:
        path = self.path(revision)
        if not path.is_file():
            raise StoreError(f"revision {revision[:12]} is not in the store")
        try:
            with safe_open(str(path), framework="pt") as f:
                meta = f.metadata() or {}
                if meta.get("format") != STORE_FORMAT:
                    raise StoreError(f"{path.name}: not a {STORE_FORMAT} file")
                manifest = json.loads(meta["manifest"])
                scales = {(m["layer"], m["target"]): float(m["scale"]) for m in manifest["modules"]}
                # Own fresh storage, as the importer does: never an alias of the file's mapping.
                pairs = {
                    key: LoRAPair(_owned(f, f"{key[0]}.{key[1]}.a"), _owned(f, f"{key[0]}.{key[1]}.b"), scale)
                    for key, scale in scales.items()
                }
        except StoreError:
            raise
        except Exception as err:  # a truncated or otherwise damaged file
            raise StoreError(f"{path.name}: unreadable ({err})") from None
        imported = ImportedAdapter(AdapterWeights(pairs), manifest)
        if adapter_revision(imported) != revision:
            raise StoreError(f"{path.name}: content does not match its revision (damaged on disk?)")
        return imported

    def remove(self, revision: str) -> None:
        self.path(revision).unlink(missing_ok=True)


def _owned(f: Any, name: str) -> torch.Tensor:  # noqa: ANN401
    tensor: torch.Tensor = f.get_tensor(name).clone(memory_format=torch.contiguous_format)
    return tensor
