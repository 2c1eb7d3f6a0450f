"""What the engine thread hands a request's consumer per step: the delta, not the output so far.

A cumulative snapshot per step copies the output's token ids and logprobs each time (quadratic in
the output's length, on the step thread, which every stream waits for). A delta carries what the
step added; the consumer assembles what it needs: a stream only the new piece (and a tail it holds
back), a non-streaming response the whole output at the end.

Text is not append-only: a stop string that completes in this step cuts the text where it starts,
which can be before the end of the text delivered so far (a stop string straddling two steps). So a
delta's text replaces the request's text from `text_start` on; `text_start` is below the length
delivered only in that case, and never below what a stream has sent (it holds back the longest stop
string's length minus one, see render.TextStreamer).
"""

from __future__ import annotations

from typing import NamedTuple

from loraplex.engine.sequence import Sequence, SequenceStatus
from loraplex.types import AdapterRef, Logprobs, RequestOutput


class OutputDelta(NamedTuple):
    """What one request's output gained over one or more steps. (A NamedTuple: the step thread
    makes one per request per step.)"""

    token_ids: list[int]  # the new tokens
    text_start: int  # where `text` starts in the request's text (see the module docstring)
    text: str
    logprobs: list[Logprobs] | None  # one per new token; None when the request asked for none
    finished: bool
    finish_reason: str | None
    # The first delta of a request only (None on the others): what a response needs once.
    prompt_token_ids: list[int] | None = None
    prompt_logprobs: list[Logprobs | None] | None = None
    adapter: AdapterRef | None = None
    num_cached_tokens: int = 0  # prompt tokens whose K/V came from the prefix cache (usage's cached_tokens)
    error: str | None = None  # the last delta of a request the engine ended itself: why


class Cursor:
    """On the engine thread: how much of one request's output its consumer has been handed."""

    __slots__ = ("num_tokens", "text_len", "started")

    def __init__(self) -> None:
        self.num_tokens = 0
        self.text_len = 0
        self.started = False

    def advance(
        self,
        token_ids: list[int],
        text: str,
        logprobs: list[Logprobs] | None,
        finished: bool,
        finish_reason: str | None,
    ) -> OutputDelta:
        """The delta from what was handed over to the output now (`token_ids`, `text`, `logprobs`:
        the whole output, read, not copied)."""
        start = self.num_tokens
        text_start = min(self.text_len, len(text))
        self.num_tokens = len(token_ids)
        self.text_len = len(text)
        new_lps = None if logprobs is None else logprobs[start:]
        return OutputDelta(token_ids[start:], text_start, text[text_start:], new_lps, finished, finish_reason)

    def of_sequence(self, seq: Sequence) -> OutputDelta:
        """The delta of a live engine sequence (the step's hand-off; `advance`, inlined: the step
        thread makes one per stream per step)."""
        tokens, text, params = seq.output_token_ids, seq.text, seq.params
        start, text_len = self.num_tokens, len(text)
        text_start = self.text_len if self.text_len < text_len else text_len
        self.num_tokens, self.text_len = len(tokens), text_len
        delta = OutputDelta(
            tokens[start:],
            text_start,
            text[text_start:],
            None if params.logprobs is None else seq.logprobs[start:],
            seq.status is SequenceStatus.FINISHED,
            seq.finish_reason,
        )
        if seq.error is not None:
            delta = delta._replace(error=seq.error)
        if self.started:
            return delta
        self.started = True
        # The prompt's logprobs are copied, once: a preempted request records them again.
        plps = list(seq.prompt_logprobs) if params.prompt_logprobs is not None else None
        return delta._replace(
            prompt_token_ids=seq.prompt_token_ids,
            prompt_logprobs=plps,
            adapter=seq.adapter,
            num_cached_tokens=seq.num_cached_tokens,
        )

    def of_output(self, out: RequestOutput) -> OutputDelta:
        """The delta of a snapshot (an aborted request's final output)."""
        delta = self.advance(out.token_ids, out.text, out.logprobs, out.finished, out.finish_reason)
        if out.error is not None:
            delta = delta._replace(error=out.error)
        if self.started:
            return delta
        self.started = True
        return delta._replace(
            prompt_token_ids=out.prompt_token_ids,
            prompt_logprobs=out.prompt_logprobs,
            adapter=out.adapter,
            num_cached_tokens=out.num_cached_tokens,
        )


class Accumulator:
    """Joins consecutive deltas of one request into one: all of them for a non-streaming response,
    the ones queued since a stream last read (it then sends one chunk for several steps)."""

    def __init__(self, first: OutputDelta) -> None:
        self.first = first
        self.token_ids = list(first.token_ids)
        self.logprobs = None if first.logprobs is None else list(first.logprobs)
        self.text_start = first.text_start
        # Pieces joined once at the end: appending to one string would copy it every step.
        self.pieces = [first.text]
        self.text_len = len(first.text)
        self.last = first

    def add(self, delta: OutputDelta) -> None:
        self.token_ids += delta.token_ids
        if self.logprobs is not None and delta.logprobs is not None:
            self.logprobs += delta.logprobs
        keep = delta.text_start - self.text_start  # characters of ours that stay before its text
        if keep < 0:  # it cuts into text before ours: its text replaces all of ours
            self.text_start, self.pieces, self.text_len = delta.text_start, [], 0
        elif keep < self.text_len:  # a stop string cut some of ours
            self.pieces = ["".join(self.pieces)[:keep]]
            self.text_len = keep
        self.pieces.append(delta.text)
        self.text_len += len(delta.text)
        self.last = delta

    def delta(self) -> OutputDelta:
        first, last = self.first, self.last
        return OutputDelta(
            self.token_ids,
            self.text_start,
            "".join(self.pieces),
            self.logprobs,
            last.finished,
            last.finish_reason,
            first.prompt_token_ids,
            first.prompt_logprobs,
            first.adapter,
            first.num_cached_tokens,
            last.error,
        )

    def output(self, request_id: str) -> RequestOutput:
        """The whole output, when the first delta added was the request's first."""
        first, last = self.first, self.last
        return RequestOutput(
            request_id=request_id,
            prompt_token_ids=first.prompt_token_ids or [],
            adapter=first.adapter,
            token_ids=self.token_ids,
            text="".join(self.pieces),
            logprobs=self.logprobs,
            prompt_logprobs=first.prompt_logprobs,
            finished=last.finished,
            finish_reason=last.finish_reason,
            num_cached_tokens=first.num_cached_tokens,
            error=last.error,
        )
