"""An HTTP body -> the engine requests it asks for, or the 4xx that refuses it.

Everything here runs in the server's worker pool, never on the engine's step thread or the
asyncio loop: JSON parsing, validation, chat-template rendering and tokenization all scale with
the request's size, and a large request must not delay anyone else's tokens. A request refused
here costs the engine nothing. (Tokenizers from `transformers` release the interpreter lock
while they encode, so a long prompt tokenized here does not hold up the step thread either.)
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError

from loraplex.server.body_json import parse_json_body
from loraplex.server.choices import ChoiceRun
from loraplex.server.limits import ServerLimits, check_count, too_large
from loraplex.server.protocol import (
    APIError,
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
)
from loraplex.types import SamplingParams

_M = TypeVar("_M", bound=BaseModel)

LEGACY_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions


@dataclass(frozen=True)
class PreparedRequest:
    model: str  # as the client named it (echoed in the response)
    adapter: str | None  # None: the base model
    runs: list[ChoiceRun]
    stream: bool
    include_usage: bool
    chat: bool
    cache_salt: str | None = None  # only requests with the same salt share prefix-cache blocks
    priority: int = 0  # among the tenant's own requests (engine/policies.py)
    deadline_s: float | None = None  # the first token's deadline, seconds after arrival


class RequestPreparer:
    def __init__(
        self,
        tokenizer: Any,
        served_model: str,
        max_model_len: int,
        vocab_size: int,
        limits: ServerLimits,
    ) -> None:
        self.tokenizer = tokenizer
        self.served_model = served_model
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size
        self.limits = limits
        self.max_prompt_tokens = min(limits.max_prompt_tokens or max_model_len, max_model_len)
        # No token covers more characters than the longest vocabulary entry (a byte-level or
        # sentencepiece entry is at least as long as the text it stands for), so a string longer
        # than this cannot fit the context and is refused without tokenizing it.
        self.max_prompt_chars = max_model_len * longest_token_chars(tokenizer)

    # --- the two routes ---------------------------------------------------------------------------

    def completion(self, body: bytes) -> PreparedRequest:
        req = self._parse(body, CompletionRequest)
        _refuse_unsupported(req)
        if req.best_of not in (None, 1, req.n):
            raise APIError(400, "best_of other than n is not supported", param="best_of")
        if req.suffix:
            raise APIError(400, "suffix is not supported", param="suffix")
        prompts = _prompt_list(req.prompt)
        self._check_counts(req, len(prompts), req.logprobs, "logprobs")
        if req.max_tokens is not None and (req.max_tokens < 0 or (req.max_tokens == 0 and not req.echo)):
            raise APIError(
                400,
                f"max_tokens must be >= 1 (0 only with echo, to score the prompt), got {req.max_tokens}",
                param="max_tokens",
            )
        runs = []
        for p_i, prompt in enumerate(prompts):
            where = "prompt" if len(prompts) == 1 else f"prompt[{p_i}]"
            ids = self._prompt_ids(prompt, where, special_tokens=True)
            max_tokens = self._max_tokens(req.max_tokens, len(ids), LEGACY_DEFAULT_MAX_TOKENS)
            echo_text = None
            if req.echo:
                echo_text = prompt if isinstance(prompt, str) else self._decode(ids)
            for j in range(req.n):
                index = p_i * req.n + j
                params = self._sampling(req, max_tokens, req.logprobs, index)
                if req.echo and req.logprobs is not None:
                    params = _with_prompt_logprobs(params, req.logprobs)
                runs.append(ChoiceRun(index=index, prompt=ids, params=params, echo_text=echo_text))
        return self._prepared(req, runs, chat=False)

    def chat(self, body: bytes) -> PreparedRequest:
        req = self._parse(body, ChatCompletionRequest)
        _refuse_unsupported(req)
        if req.tools:
            raise APIError(400, "tools are not supported", param="tools")
        if req.response_format and req.response_format.get("type", "text") != "text":
            raise APIError(400, "only the text response_format is supported", param="response_format")
        if not req.logprobs and req.top_logprobs:
            raise APIError(400, "top_logprobs needs logprobs=true", param="top_logprobs")
        top_n = (req.top_logprobs or 0) if req.logprobs else None
        self._check_counts(req, 1, req.top_logprobs, "top_logprobs")
        requested = req.max_tokens if req.max_tokens is not None else req.max_completion_tokens
        if requested is not None and requested < 1:
            raise APIError(400, f"max_tokens must be >= 1, got {requested}", param="max_tokens")
        text = self._render_chat(req.messages)
        # The template renders the model's own special tokens (BOS and turn markers): add none.
        ids = self._prompt_ids(text, "messages", special_tokens=False)
        max_tokens = self._max_tokens(requested, len(ids), self.max_model_len - len(ids))
        runs = [
            ChoiceRun(index=j, prompt=ids, params=self._sampling(req, max_tokens, top_n, j))
            for j in range(req.n)
        ]
        return self._prepared(req, runs, chat=True)

    # --- pieces -----------------------------------------------------------------------------------

    def _parse(self, body: bytes, model: type[_M]) -> _M:
        return parse_model(body, model, self.limits.max_json_depth)

    def _check_counts(
        self, req: CompletionRequest | ChatCompletionRequest, prompts: int, logprobs: int | None, name: str
    ) -> None:
        lim = self.limits
        check_count(req.n, lim.max_sequences_per_request, "n", "n")
        check_count(prompts * req.n, lim.max_sequences_per_request, "prompts x n", "prompt")
        stop = req.stop_strings()
        check_count(len(stop), lim.max_stop_strings, "the number of stop strings", "stop")
        longest = max((len(s) for s in stop), default=0)
        check_count(longest, lim.max_stop_string_chars, "the longest stop string's length", "stop")
        check_count(len(req.stop_token_ids or ()), lim.max_stop_strings, "stop_token_ids' length", "stop")
        if logprobs is not None:
            check_count(logprobs, lim.max_logprobs, name, name)

    def _prompt_ids(self, prompt: str | list[int], where: str, special_tokens: bool) -> list[int]:
        param = where.split("[")[0]
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise APIError(400, "this model has no tokenizer: give prompts as token ids", param=param)
            if len(prompt) > self.max_prompt_chars:
                raise APIError(
                    400,
                    f"{where} has {len(prompt)} characters, more than can fit the context length of "
                    f"{self.max_model_len} tokens",
                    param=param,
                )
            ids = list(self.tokenizer.encode(prompt, add_special_tokens=special_tokens, verbose=False))
        else:
            ids = prompt
            bad = [t for t in ids if not 0 <= t < self.vocab_size]
            if bad:
                raise APIError(
                    400, f"{where} has token ids out of range [0, {self.vocab_size}): {bad[:5]}", param=param
                )
        if not ids:
            raise APIError(400, f"{where} is empty", param=param)
        if len(ids) > self.max_model_len:
            raise APIError(
                400,
                f"{where} has {len(ids)} tokens; the context length is {self.max_model_len}",
                param=param,
            )
        if len(ids) > self.max_prompt_tokens:
            raise too_large(
                f"{where} has {len(ids)} tokens; the server's limit is {self.max_prompt_tokens}", param
            )
        return ids

    def _max_tokens(self, requested: int | None, prompt_len: int, default: int) -> int:
        """An explicit max_tokens that overflows the context is a 400; an omitted one is clamped to
        the room left (as vLLM does)."""
        room = self.max_model_len - prompt_len
        if requested is None:
            if room < 1:
                raise APIError(
                    400,
                    f"the prompt has {prompt_len} tokens, which fills the context length of "
                    f"{self.max_model_len}: no room to generate",
                    param="prompt",
                )
            return min(default, room)
        if requested > room:
            raise APIError(
                400,
                f"the prompt ({prompt_len} tokens) plus max_tokens ({requested}) is more than the context "
                f"length of {self.max_model_len}",
                param="max_tokens",
            )
        return requested

    def _sampling(
        self,
        req: CompletionRequest | ChatCompletionRequest,
        max_tokens: int,
        logprobs: int | None,
        choice: int,
    ) -> SamplingParams:
        try:
            return SamplingParams(
                max_tokens=max_tokens,
                temperature=req.temperature,
                top_p=req.top_p,
                top_k=req.top_k,
                seed=req.choice_seed(choice),
                stop=tuple(req.stop_strings()),
                stop_token_ids=tuple(req.stop_token_ids or ()),
                ignore_eos=req.ignore_eos,
                logprobs=logprobs,
            )
        except ValueError as err:
            raise APIError(400, str(err)) from None

    def _render_chat(self, messages: list[ChatMessage]) -> str:
        if self.tokenizer is None or not getattr(self.tokenizer, "chat_template", None):
            raise APIError(400, "this model has no chat template; use /v1/completions")
        rendered = []
        for i, m in enumerate(messages):
            content = m.content
            if isinstance(content, list):
                if any(part.type != "text" for part in content):
                    raise APIError(
                        400, "only text content parts are supported", param=f"messages[{i}].content"
                    )
                content = "".join(part.text or "" for part in content)
            rendered.append({"role": m.role, "content": content or ""})
        if sum(len(m["content"]) for m in rendered) > self.max_prompt_chars:
            raise APIError(
                400, f"the messages cannot fit the context length of {self.max_model_len}", param="messages"
            )
        try:
            text: str = self.tokenizer.apply_chat_template(
                rendered, tokenize=False, add_generation_prompt=True
            )
            return text
        except Exception as err:  # a template may reject a conversation (e.g. role order)
            raise APIError(400, f"chat template rejected the messages: {err}", param="messages") from None

    def _decode(self, ids: list[int]) -> str:
        return "" if self.tokenizer is None else self.tokenizer.decode(ids)

    def _prepared(
        self, req: CompletionRequest | ChatCompletionRequest, runs: list[ChoiceRun], chat: bool
    ) -> PreparedRequest:
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        adapter = None if req.model == self.served_model else req.model
        deadline_s = None if req.deadline_ms is None else req.deadline_ms / 1000
        return PreparedRequest(
            req.model,
            adapter,
            runs,
            req.stream,
            include_usage,
            chat,
            req.cache_salt,
            req.priority,
            deadline_s,
        )


def parse_model(body: bytes, model: type[_M], max_json_depth: int) -> _M:
    """A JSON object body validated as `model`; a 400 naming the first problem otherwise."""
    value = parse_json_body(body, max_json_depth)
    if not isinstance(value, dict):
        raise APIError(400, f"the request body must be a JSON object, got {type(value).__name__}")
    try:
        return model.model_validate(value)
    except ValidationError as err:
        first = err.errors(include_url=False)[0]
        loc = [str(p) for p in first.get("loc", ())]
        where = ".".join(loc)
        param = loc[0] if loc else None
        raise APIError(400, f"invalid request: {where}: {first.get('msg')}", param=param) from None


def longest_token_chars(tokenizer: Any) -> int:
    if tokenizer is None:
        return 1
    return max((len(tok) for tok in tokenizer.get_vocab()), default=1)


def _prompt_list(prompt: str | list[str] | list[int] | list[list[int]]) -> list[str | list[int]]:
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise APIError(400, "prompt is empty", param="prompt")
    if all(isinstance(x, int) for x in prompt):
        return [list(prompt)]  # type: ignore[arg-type]
    return list(prompt)  # type: ignore[arg-type]


def _refuse_unsupported(req: CompletionRequest | ChatCompletionRequest) -> None:
    if req.presence_penalty or req.frequency_penalty:
        raise APIError(
            400, "presence_penalty and frequency_penalty are not supported", param="presence_penalty"
        )
    if req.logit_bias:
        raise APIError(400, "logit_bias is not supported", param="logit_bias")


def _with_prompt_logprobs(params: SamplingParams, top_n: int) -> SamplingParams:
    return replace(params, prompt_logprobs=top_n)
