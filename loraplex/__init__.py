"""loraplex: serve many LoRA adapters on one shared base model."""

from loraplex.llm import LLM
from loraplex.types import AdapterRef, RequestOutput, SamplingParams

__all__ = ["LLM", "AdapterRef", "RequestOutput", "SamplingParams"]
