"""OpenAI-compatible request bodies, validated strictly.

Types are strict (`"n": "2"` and `"stream": "true"` are refused, as is `true` for a number) and
every float must be finite (NaN and ±Infinity are refused). Unknown fields are ignored (clients
send many; the body-size limit bounds their bulk); fields that would change the output in a way
the engine does not implement (penalties, logit_bias, best_of other than n, suffix, tools) are
refused with a 400 rather than silently ignored (see `prepare.py`).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from loraplex.server.errors import APIError

__all__ = ["APIError", "ChatCompletionRequest", "CompletionRequest", "ErrorResponse"]

_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1
MAX_DEADLINE_MS = 3_600_000


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(BaseModel):
    """The body of every 4xx and 5xx answer."""

    error: ErrorDetail


_STRICT = ConfigDict(extra="ignore", strict=True, allow_inf_nan=False)


class StreamOptions(BaseModel):
    model_config = _STRICT

    include_usage: bool = False  # a final chunk with `usage` and empty `choices`, as OpenAI sends


class _SamplingFields(BaseModel):
    model_config = _STRICT

    model: str
    max_tokens: int | None = None
    # bounded: past float32's range a temperature turns into infinity on the way to the sampler
    temperature: float = Field(default=1.0, ge=0, le=1e6)
    top_p: float = Field(default=1.0, gt=0, le=1)
    n: int = Field(default=1, ge=1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = Field(default=None, ge=_INT64_MIN, le=_INT64_MAX)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    # Extensions that vLLM users expect.
    top_k: int = Field(default=0, ge=-1)
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    # Only requests with the same salt share prefix-cache blocks (as vLLM accepts it): a client
    # that wants its prompts unobservable through time to first token sends a secret one.
    cache_salt: str | None = Field(default=None, min_length=1, max_length=1024)
    # Admission order among the tenant's own requests under the adaptive policy (higher first).
    priority: int = Field(default=0, ge=-1000, le=1000)
    # The first token's deadline, in milliseconds after the request arrives: the adaptive policy
    # admits the request ahead of fairness as it nears, and /metrics counts the misses. Up to an
    # hour: a longer one could never be the reason a request goes first.
    deadline_ms: float | None = Field(default=None, gt=0, le=MAX_DEADLINE_MS)

    def stop_strings(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    def choice_seed(self, choice: int) -> int | None:
        """The seed of one of the n choices: they must not all be one draw. Wraps within int64."""
        if self.seed is None:
            return None
        return (self.seed + choice - _INT64_MIN) % 2**64 + _INT64_MIN


class CompletionRequest(_SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = Field(default=None, ge=0)
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None


class TextPart(BaseModel):
    model_config = _STRICT

    type: str
    text: str | None = None


class ChatMessage(BaseModel):
    model_config = _STRICT

    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[TextPart] | None = None


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0)
    tools: list[dict[str, Any]] | None = None
    response_format: dict[str, Any] | None = None
