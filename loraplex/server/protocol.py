"""OpenAI-compatible request bodies and the conversion to SamplingParams.

Unknown fields are ignored (clients send many); fields that would change the output in a way the
engine does not implement (penalties, logit_bias, echo, best_of > 1, tools) are refused with a 400
rather than silently ignored.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from loraplex.types import SamplingParams

MAX_LOGPROBS = 20


class APIError(Exception):
    """An error with its HTTP status, rendered as OpenAI's error JSON."""

    def __init__(
        self,
        status: int,
        message: str,
        type_: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type_
        self.param = param
        self.code = code

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


class StreamOptions(BaseModel):
    include_usage: bool = True


class _SamplingFields(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str
    max_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    n: int = Field(default=1, ge=1, le=16)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    # Extensions that vLLM users expect.
    top_k: int = 0
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None

    def _refuse_unsupported(self) -> None:
        if self.presence_penalty or self.frequency_penalty:
            raise APIError(
                400, "presence_penalty and frequency_penalty are not supported", param="presence_penalty"
            )
        if self.logit_bias:
            raise APIError(400, "logit_bias is not supported", param="logit_bias")

    def sampling_params(self, max_tokens_default: int, logprobs: int | None, choice: int) -> SamplingParams:
        self._refuse_unsupported()
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        max_tokens = self.max_tokens if self.max_tokens is not None else max_tokens_default
        seed = None if self.seed is None else self.seed + choice  # n choices must not all be one draw
        try:
            return SamplingParams(
                max_tokens=max_tokens,
                temperature=self.temperature,
                top_p=self.top_p,
                top_k=self.top_k,
                seed=seed,
                stop=tuple(stop),
                stop_token_ids=tuple(self.stop_token_ids or ()),
                ignore_eos=self.ignore_eos,
                logprobs=logprobs,
            )
        except ValueError as err:
            raise APIError(400, str(err)) from None


class CompletionRequest(_SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None

    def prompts(self) -> list[str | list[int]]:
        if self.echo:
            raise APIError(400, "echo is not supported", param="echo")
        if self.best_of not in (None, 1, self.n):
            raise APIError(400, "best_of other than n is not supported", param="best_of")
        if self.suffix:
            raise APIError(400, "suffix is not supported", param="suffix")
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if not p:
            raise APIError(400, "prompt is empty", param="prompt")
        if all(isinstance(x, int) for x in p):
            return [list(p)]  # type: ignore[arg-type]
        return list(p)  # type: ignore[arg-type]


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[dict[str, Any]] | None = None

    @field_validator("content")
    @classmethod
    def _text_only(cls, value: Any) -> Any:
        if isinstance(value, list):
            if any(part.get("type") != "text" for part in value):
                raise ValueError("only text content parts are supported")
            return "".join(str(part.get("text", "")) for part in value)
        return value


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    tools: list[dict[str, Any]] | None = None
    response_format: dict[str, Any] | None = None

    def chat_logprobs(self) -> int | None:
        if self.tools:
            raise APIError(400, "tools are not supported", param="tools")
        if self.response_format and self.response_format.get("type", "text") != "text":
            raise APIError(400, "only the text response_format is supported", param="response_format")
        if self.max_tokens is None and self.max_completion_tokens is not None:
            self.max_tokens = self.max_completion_tokens
        if not self.logprobs:
            if self.top_logprobs:
                raise APIError(400, "top_logprobs needs logprobs=true", param="top_logprobs")
            return None
        return self.top_logprobs or 0
