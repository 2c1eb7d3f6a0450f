"""Architecture name -> model class. The whole supported family shares one implementation."""

from __future__ import annotations

from loraplex.config import SUPPORTED_ARCHITECTURES
from loraplex.model.llama import LlamaFamilyModel

MODEL_CLASSES: dict[str, type[LlamaFamilyModel]] = {
    arch: LlamaFamilyModel for arch in SUPPORTED_ARCHITECTURES
}
