"""A request's prompt as token ids, checked against the vocabulary, and the model's end tokens."""

from __future__ import annotations

from typing import Any

from loraplex.config import ModelConfig


def prompt_token_ids(prompt: str | list[int], tokenizer: Any | None, vocab_size: int) -> list[int]:  # noqa: ANN401
    """Token ids of `prompt` (a string is tokenized); ValueError for an empty prompt, a string
    without a tokenizer, or an id outside the vocabulary."""
    if isinstance(prompt, str):
        if tokenizer is None:
            raise ValueError("this model has no tokenizer: give prompts as token ids")
        ids = list(tokenizer.encode(prompt))
    else:
        ids = [int(t) for t in prompt]
    if not ids:
        raise ValueError("prompt is empty")
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        raise ValueError(f"prompt token ids out of range [0, {vocab_size}): {bad[:5]}")
    return ids


def eos_token_ids(config: ModelConfig, tokenizer: Any | None) -> frozenset[int]:  # noqa: ANN401
    ids = set(config.eos_token_ids)
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    return frozenset(ids)
