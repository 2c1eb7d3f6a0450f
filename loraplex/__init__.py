"""loraplex: serve many LoRA adapters on one shared base model."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from loraplex.types import AdapterRef, RequestOutput, SamplingParams

if TYPE_CHECKING:
    from loraplex.llm import LLM

__all__ = ["LLM", "AdapterRef", "RequestOutput", "SamplingParams"]


def __getattr__(name: str) -> Any:  # noqa: ANN401
    # LLM pulls in torch and the engine: loaded on first use, so that the torch-free parts of the
    # package (the adapter registry, the server's limits and protocol) import without them.
    if name == "LLM":
        from loraplex.llm import LLM

        return LLM
    raise AttributeError(f"module 'loraplex' has no attribute {name!r}")
