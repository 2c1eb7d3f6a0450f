"""Engine outputs -> OpenAI response bodies; per-step deltas -> stream chunks."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Sequence
from typing import Any

from loraplex.server.choices import ChoiceRun
from loraplex.server.deltas import Accumulator, OutputDelta
from loraplex.server.errors import load_failed
from loraplex.types import Logprobs, RequestOutput


class TextStreamer:
    """Emits text deltas that never need taking back: holds back a tail that could still turn into
    a stop string (which is cut from the output) or an incomplete multi-byte character."""

    def __init__(self, stop: Sequence[str]) -> None:
        self.holdback = max((len(s) for s in stop), default=1) - 1
        self.sent = 0  # characters sent
        self.pending = ""  # the text after them, received and not sent yet

    def feed(self, start: int, text: str, finished: bool) -> str:
        """Take a delta's text, which replaces the request's text from `start` on (a stop string
        cuts only held-back text), and return what can be sent now."""
        keep = start - self.sent
        if keep < 0:  # would take back sent text (the holdback rules it out): keep what was sent
            text = text[-keep:]
            keep = 0
        pending = self.pending[:keep] + text if keep < len(self.pending) else self.pending + text
        end = len(pending) if finished else len(pending) - self.holdback
        if not finished:
            while end > 0 and pending[end - 1] == "\ufffd":
                end -= 1
        if end <= 0:
            self.pending = pending
            return ""
        self.pending = pending[end:]
        self.sent += end
        return pending[:end]


# Logprobs render as finite numbers: JSON has no -Infinity, and a token the model rules out entirely
# (a -inf logit) gets this instead, as vLLM does.
LOGPROB_FLOOR = -9999.0


def finite_logprob(value: float) -> float:
    return value if value >= LOGPROB_FLOOR else LOGPROB_FLOOR  # NaN compares false: floored too


class Renderer:
    def __init__(self, tokenizer: Any, served_model: str) -> None:
        self.tokenizer = tokenizer
        self.served_model = served_model

    def token_text(self, token_id: int) -> str:
        return "" if self.tokenizer is None else self.tokenizer.decode([token_id])

    # --- logprobs -------------------------------------------------------------------------------

    def completion_logprobs(
        self, token_ids: list[int], logprobs: list[Logprobs] | None, offset: int
    ) -> dict[str, Any] | None:
        """OpenAI's legacy logprobs of these generated tokens; text offsets count from `offset` (the
        characters of the choice's text before them). None when the request asked for none."""
        if logprobs is None:
            return None
        tokens, token_lps, tops, offsets = [], [], [], []
        for tid, lps in zip(token_ids, logprobs, strict=True):
            text = self.token_text(tid)
            tokens.append(text)
            token_lps.append(finite_logprob(lps[tid]))
            tops.append(self._top(lps))
            offsets.append(offset)
            offset += len(text)
        return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}

    def prompt_logprobs(
        self, prompt_token_ids: list[int], prompt_logprobs: list[Logprobs | None] | None
    ) -> dict[str, Any]:
        """The legacy logprobs of an echoed prompt: the first token has no context, so its logprob
        and top entries are null."""
        tokens, token_lps, tops, offsets = [], [], [], []
        offset = 0
        plps = prompt_logprobs or [None] * len(prompt_token_ids)
        for tid, lps in zip(prompt_token_ids, plps, strict=True):
            text = self.token_text(tid)
            tokens.append(text)
            token_lps.append(None if lps is None else finite_logprob(lps[tid]))
            tops.append(None if lps is None else self._top(lps))
            offsets.append(offset)
            offset += len(text)
        return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}

    def _top(self, lps: dict[int, float]) -> dict[str, float]:
        return {self.token_text(t): finite_logprob(lp) for t, lp in lps.items()}

    def chat_logprobs(
        self, token_ids: list[int], logprobs: list[Logprobs] | None, top_n: int
    ) -> dict[str, Any] | None:
        if logprobs is None:
            return None
        content = []
        for tid, lps in zip(token_ids, logprobs, strict=True):
            top = sorted(lps.items(), key=lambda kv: -kv[1])[:top_n]
            content.append(
                {
                    "token": self.token_text(tid),
                    "logprob": finite_logprob(lps[tid]),
                    "bytes": list(self.token_text(tid).encode()),
                    "top_logprobs": [
                        {
                            "token": self.token_text(t),
                            "logprob": finite_logprob(lp),
                            "bytes": list(self.token_text(t).encode()),
                        }
                        for t, lp in top
                    ],
                }
            )
        return {"content": content}

    # --- whole responses ------------------------------------------------------------------------

    def full(
        self, request_id: str, model: str, runs: list[ChoiceRun], finals: list[RequestOutput], chat: bool
    ) -> dict[str, Any]:
        choices = []
        for run, out in zip(runs, finals, strict=True):
            if chat:
                choices.append(
                    {
                        "index": run.index,
                        "message": {"role": "assistant", "content": out.text},
                        "logprobs": self.chat_logprobs(out.token_ids, out.logprobs, run.params.logprobs or 0),
                        "finish_reason": out.finish_reason,
                    }
                )
            else:
                choices.append(
                    {
                        "index": run.index,
                        "text": (run.echo_text or "") + out.text,
                        "logprobs": self._full_completion_logprobs(run, out),
                        "finish_reason": out.finish_reason,
                    }
                )
        return {
            "id": request_id,
            "object": "chat.completion" if chat else "text_completion",
            "created": int(time.time()),
            "model": model,
            "choices": choices,
            "usage": _usage(
                runs,
                [len(f.prompt_token_ids) for f in finals],
                [len(f.token_ids) for f in finals],
                [f.num_cached_tokens for f in finals],
            ),
        }

    def _full_completion_logprobs(self, run: ChoiceRun, out: RequestOutput) -> dict[str, Any] | None:
        if out.logprobs is None:
            return None
        generated = self.completion_logprobs(out.token_ids, out.logprobs, len(run.echo_text or ""))
        if run.echo_text is None:
            return generated
        return _joined(self.prompt_logprobs(out.prompt_token_ids, out.prompt_logprobs), generated)

    async def stream(
        self,
        request_id: str,
        model: str,
        runs: list[ChoiceRun],
        queues: list[asyncio.Queue[OutputDelta]],
        chat: bool,
        include_usage: bool,
    ) -> AsyncIterator[dict[str, Any]]:
        created = int(time.time())
        head = {
            "id": request_id,
            "object": "chat.completion.chunk" if chat else "text_completion",
            "created": created,
            "model": model,
        }
        # One choice (the usual case) reads its queue directly; several are merged by pump tasks.
        merged: asyncio.Queue[tuple[int, OutputDelta]] | None = None
        pumps = []
        if len(queues) > 1:
            merged = asyncio.Queue()
            pumps = [asyncio.create_task(_pump(i, q, merged)) for i, q in enumerate(queues)]
        streamers = [TextStreamer(run.params.stop) for run in runs]
        # What the usage chunk counts: each choice's prompt and its cached part (on its first
        # delta) and its tokens.
        prompt_lens = [0] * len(runs)
        cached = [0] * len(runs)
        num_tokens = [0] * len(runs)
        # Where each choice's next token starts in its text (the legacy logprobs' text_offset): by
        # the tokens' own text, as in a full response, not by the text sent, which a stream holds
        # back while it could still be a stop string.
        offsets = [len(run.echo_text or "") for run in runs]
        finished = [False] * len(runs)
        try:
            if chat:
                for run in runs:
                    yield {
                        **head,
                        "choices": [
                            {
                                "index": run.index,
                                "delta": {"role": "assistant", "content": ""},
                                "logprobs": None,
                                "finish_reason": None,
                            }
                        ],
                    }
            echoed = [run.echo_text is None for run in runs]
            while not all(finished):
                for i, delta in (await _pending(queues[0], merged)).items():
                    run = runs[i]
                    if delta.prompt_token_ids is not None:  # the choice's first delta
                        prompt_lens[i] = len(delta.prompt_token_ids)
                        cached[i] = delta.num_cached_tokens
                    if not echoed[i]:  # the prompt goes out first, with the first delta's logprobs
                        echoed[i] = True
                        lp = None
                        if delta.prompt_logprobs is not None:
                            lp = self.prompt_logprobs(delta.prompt_token_ids or [], delta.prompt_logprobs)
                        yield {
                            **head,
                            "choices": [
                                {
                                    "index": run.index,
                                    "text": run.echo_text,
                                    "logprobs": lp,
                                    "finish_reason": None,
                                }
                            ],
                        }
                    text = streamers[i].feed(delta.text_start, delta.text, delta.finished)
                    if chat:
                        lp = self.chat_logprobs(delta.token_ids, delta.logprobs, run.params.logprobs or 0)
                        choice = {
                            "index": run.index,
                            "delta": {"content": text} if text else {},
                            "logprobs": lp,
                        }
                    else:
                        lp = self.completion_logprobs(delta.token_ids, delta.logprobs, offsets[i])
                        if lp is not None and lp["tokens"]:
                            offsets[i] = lp["text_offset"][-1] + len(lp["tokens"][-1])
                        choice = {"index": run.index, "text": text, "logprobs": lp}
                    num_tokens[i] += len(delta.token_ids)
                    if delta.error is not None:  # headers are sent: the error goes as an event
                        yield load_failed(delta.error).body()
                    choice["finish_reason"] = delta.finish_reason if delta.finished else None
                    finished[i] = delta.finished
                    if text or delta.finished or lp is not None:
                        yield {**head, "choices": [choice]}
            if include_usage:
                yield {**head, "choices": [], "usage": _usage(runs, prompt_lens, num_tokens, cached)}
        finally:
            for p in pumps:
                p.cancel()


def _joined(a: dict[str, Any], b: dict[str, Any] | None) -> dict[str, Any]:
    if b is None:
        return a
    return {key: a[key] + b[key] for key in a}


async def _pending(
    single: asyncio.Queue[OutputDelta], merged: asyncio.Queue[tuple[int, OutputDelta]] | None
) -> dict[int, OutputDelta]:
    """The deltas of each choice with new output, waiting for one, every one queued since the last
    call joined into one per choice: a consumer that fell behind by several steps sends one chunk
    for them, not one per step (at hundreds of streams the event loop's cost per chunk is what
    falls behind)."""
    if merged is None:
        delta = await single.get()
        if single.empty():
            return {0: delta}
        joined = Accumulator(delta)
        while not single.empty():
            joined.add(single.get_nowait())
        return {0: joined.delta()}
    i, delta = await merged.get()
    firsts = {i: delta}
    joins: dict[int, Accumulator] = {}
    while not merged.empty():
        i, delta = merged.get_nowait()
        if i not in firsts:
            firsts[i] = delta
            continue
        if i not in joins:
            joins[i] = Accumulator(firsts[i])
        joins[i].add(delta)
    return {i: joins[i].delta() if i in joins else first for i, first in firsts.items()}


async def _pump(
    index: int, source: asyncio.Queue[OutputDelta], sink: asyncio.Queue[tuple[int, OutputDelta]]
) -> None:
    while True:
        delta = await source.get()
        await sink.put((index, delta))
        if delta.finished:
            return


def _usage(
    runs: list[ChoiceRun], prompt_lens: list[int], completion_lens: list[int], cached_lens: list[int]
) -> dict[str, Any]:
    """OpenAI's usage object; `prompt_tokens_details.cached_tokens` counts the prompt tokens taken
    from the prefix cache, by the same choice whose prompt tokens are counted."""
    prompt_tokens = cached_tokens = 0
    seen_prompts: set[int] = set()
    for run, prompt_len, cached in zip(runs, prompt_lens, cached_lens, strict=True):
        key = id(run.prompt)
        if key not in seen_prompts:  # n choices of one prompt count its tokens once
            seen_prompts.add(key)
            prompt_tokens += prompt_len
            cached_tokens += cached
    completion = sum(completion_lens)
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion,
        "total_tokens": prompt_tokens + completion,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }
