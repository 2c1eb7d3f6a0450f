"""User-facing value types: sampling parameters, adapter references, request outputs."""

from __future__ import annotations

from dataclasses import dataclass, field

ADAPTER_NAME_PATTERN = r"[A-Za-z0-9][A-Za-z0-9._-]*"


@dataclass(frozen=True)
class AdapterRef:
    """An adapter resolved to one immutable revision (sha256 hex of its normalized content)."""

    name: str
    revision: str

    def __str__(self) -> str:
        return f"{self.name}@{self.revision}"


@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens and when to stop.

    `temperature == 0` is greedy. `logprobs=N` returns, per generated token, a dict with the
    sampled token and the top-N tokens; `prompt_logprobs=N` the same per prompt position (the
    first is None). Logprobs are the raw log-softmax of the model's logits, taken before
    temperature, top-k and top-p.

    `max_tokens=0` scores the prompt without generating: the prompt is prefilled (computing
    `prompt_logprobs` when asked), then the request finishes with reason "length" and no tokens,
    and nothing is sampled for it. Such a prompt may fill the whole context length; with
    `max_tokens >= 1` it must leave room for at least one generated token.
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_k: int = 0  # 0 or -1: disabled
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None

    def __post_init__(self) -> None:
        # Accept lists / a single string from callers, store tuples so the object stays hashable.
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        else:
            object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))
        if self.max_tokens is None or self.max_tokens < 0:
            raise ValueError(f"max_tokens must be >= 0, got {self.max_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < -1:
            raise ValueError(f"top_k must be -1, 0 (disabled) or positive, got {self.top_k}")
        if any(not s for s in self.stop):
            raise ValueError("stop strings must be non-empty")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and value < 0:
                raise ValueError(f"{name} must be >= 0, got {value}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


Logprobs = dict[int, float]


@dataclass
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    adapter: AdapterRef | None
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    logprobs: list[Logprobs] | None = None
    prompt_logprobs: list[Logprobs | None] | None = None
    finished: bool = False
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    num_cached_tokens: int = 0  # prompt tokens whose K/V came from the prefix cache
    error: str | None = None  # set when the engine ended the request itself ("abort"): why
