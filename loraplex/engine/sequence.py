"""Per-request state the scheduler and engine track (ids and integers; the one tensor-side object
is the request's private sampling generator)."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import torch

from loraplex.engine.detokenizer import IncrementalDetokenizer
from loraplex.types import AdapterRef, Logprobs, SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    adapter: AdapterRef | None  # the revision, resolved once at admission; where it lives is residency's
    arrival: int  # admission order; FCFS and preemption priority
    generator: torch.Generator | None = None
    output_token_ids: list[int] = field(default_factory=list)
    num_computed: int = 0  # tokens whose K/V are in the cache (or are being written by a launched step)
    # Tokens sampled by launched steps and not yet on the host (Engine.step_overlapped plans the
    # next step before the last one's tokens arrive): they come after the known ones.
    pending: int = 0
    block_ids: list[int] = field(default_factory=list)
    status: SequenceStatus = SequenceStatus.WAITING
    num_preemptions: int = 0
    logprobs: list[Logprobs] = field(default_factory=list)
    prompt_logprobs: list[Logprobs | None] = field(default_factory=list)
    text: str = ""
    detokenizer: IncrementalDetokenizer | None = None
    finish_reason: str | None = None
    error: str | None = None  # why an "abort" the request did not ask for happened (a failed adapter load)
    waiting_since: float = 0.0  # the scheduler's clock (monotonic) when it last entered the waiting queue
    # Residency measurements (`engine/adapter_admission.py`): the tier its adapter was in at
    # admission (None: no adapter), when it was admitted, and since when it waits for a load.
    admission_tier: str | None = None
    admitted_at: float = 0.0
    stalled_since: float | None = None
    # The prefix cache (`kv/prefix_cache.py`): the hash chain's seed (None: the request neither
    # reads nor writes the cache), the chain hashes of its full blocks so far, how many of its
    # blocks the cache knows (hits and committed blocks), and its first admission's hit in tokens.
    cache_seed: bytes | None = None
    block_hashes: list[bytes] = field(default_factory=list)
    num_committed_blocks: int = 0
    num_cached_tokens: int = 0
    # Admission order under the adaptive policy (engine/policies.py): whose service it counts as,
    # its rank among that tenant's requests (higher first), and when (the scheduler's clock) its
    # first token is due, if it asks for a deadline.
    tenant: str = "default"
    priority: int = 0
    deadline: float | None = None
    deadline_s: float | None = None  # the same deadline as asked for: seconds after arrival

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_uncomputed(self) -> int:
        return self.num_tokens + self.pending - self.num_computed

    def token_at(self, position: int) -> int:
        p = self.prompt_len
        return self.prompt_token_ids[position] if position < p else self.output_token_ids[position - p]

    def tokens_between(self, start: int, end: int) -> list[int]:
        """The token ids at positions [start, end) (prompt, then output)."""
        p = self.prompt_len
        if end <= p:
            return self.prompt_token_ids[start:end]
        if start >= p:
            return self.output_token_ids[start - p : end - p]
        return self.prompt_token_ids[start:] + self.output_token_ids[: end - p]

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED
