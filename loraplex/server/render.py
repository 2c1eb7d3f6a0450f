"""Engine outputs -> OpenAI response bodies and stream chunks."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Sequence
from typing import Any

from loraplex.server.choices import ChoiceRun
from loraplex.types import RequestOutput


class TextStreamer:
    """Emits text deltas that never need taking back: holds back a tail that could still turn into
    a stop string (which is cut from the output) or an incomplete multi-byte character."""

    def __init__(self, stop: Sequence[str]) -> None:
        self.holdback = max((len(s) for s in stop), default=1) - 1
        self.sent = 0

    def delta(self, text: str, finished: bool) -> str:
        end = len(text) if finished else len(text) - self.holdback
        if not finished:
            while end > self.sent and text[end - 1] == "\ufffd":
                end -= 1
        if end <= self.sent:
            return ""
        out = text[self.sent : end]
        self.sent = end
        return out


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

    def completion_logprobs(self, out: RequestOutput, start: int, offset: int) -> dict[str, Any] | None:
        """OpenAI's legacy logprobs of the generated tokens from `start` on; text offsets count from
        `offset` (the characters of the choice's text before them)."""
        if out.logprobs is None:
            return None
        tokens, token_lps, tops, offsets = [], [], [], []
        for i in range(start, len(out.token_ids)):
            tid, lps = out.token_ids[i], out.logprobs[i]
            text = self.token_text(tid)
            tokens.append(text)
            token_lps.append(finite_logprob(lps[tid]))
            tops.append(self._top(lps))
            offsets.append(offset)
            offset += len(text)
        return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}

    def prompt_logprobs(self, out: RequestOutput) -> dict[str, Any]:
        """The legacy logprobs of an echoed prompt: the first token has no context, so its logprob
        and top entries are null."""
        tokens, token_lps, tops, offsets = [], [], [], []
        offset = 0
        plps = out.prompt_logprobs or [None] * len(out.prompt_token_ids)
        for tid, lps in zip(out.prompt_token_ids, plps, strict=True):
            text = self.token_text(tid)
            tokens.append(text)
            token_lps.append(None if lps is None else finite_logprob(lps[tid]))
            tops.append(None if lps is None else self._top(lps))
            offsets.append(offset)
            offset += len(text)
        return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}

    def _top(self, lps: dict[int, float]) -> dict[str, float]:
        return {self.token_text(t): finite_logprob(lp) for t, lp in lps.items()}

    def chat_logprobs(self, out: RequestOutput, start: int, top_n: int) -> dict[str, Any] | None:
        if out.logprobs is None:
            return None
        content = []
        for i in range(start, len(out.token_ids)):
            tid, lps = out.token_ids[i], out.logprobs[i]
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
                        "logprobs": self.chat_logprobs(out, 0, run.params.logprobs or 0),
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
            "usage": _usage(runs, finals),
        }

    def _full_completion_logprobs(self, run: ChoiceRun, out: RequestOutput) -> dict[str, Any] | None:
        if out.logprobs is None:
            return None
        if run.echo_text is None:
            return self.completion_logprobs(out, 0, 0)
        return _joined(self.prompt_logprobs(out), self.completion_logprobs(out, 0, len(run.echo_text)))

    async def stream(
        self,
        request_id: str,
        model: str,
        runs: list[ChoiceRun],
        queues: list[asyncio.Queue[RequestOutput]],
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
        merged: asyncio.Queue[tuple[int, RequestOutput]] | None = None
        pumps = []
        if len(queues) > 1:
            merged = asyncio.Queue()
            pumps = [asyncio.create_task(_pump(i, q, merged)) for i, q in enumerate(queues)]
        streamers = [TextStreamer(run.params.stop) for run in runs]
        tokens_sent = [0] * len(runs)
        finals: list[RequestOutput | None] = [None] * len(runs)
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
            while any(f is None for f in finals):
                for i, out in (await _newest(queues[0], merged)).items():
                    run = runs[i]
                    if not echoed[i]:  # the prompt goes out first, with the first snapshot's logprobs
                        echoed[i] = True
                        lp = self.prompt_logprobs(out) if out.prompt_logprobs is not None else None
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
                    text = streamers[i].delta(out.text, out.finished)
                    if chat:
                        lp = self.chat_logprobs(out, tokens_sent[i], run.params.logprobs or 0)
                        choice = {
                            "index": run.index,
                            "delta": {"content": text} if text else {},
                            "logprobs": lp,
                        }
                    else:
                        offset = len(run.echo_text or "") + streamers[i].sent - len(text)
                        lp = self.completion_logprobs(out, tokens_sent[i], offset)
                        choice = {"index": run.index, "text": text, "logprobs": lp}
                    tokens_sent[i] = len(out.token_ids)
                    choice["finish_reason"] = out.finish_reason if out.finished else None
                    if out.finished:
                        finals[i] = out
                    if text or out.finished or lp is not None:
                        yield {**head, "choices": [choice]}
            if include_usage:
                yield {**head, "choices": [], "usage": _usage(runs, [f for f in finals if f is not None])}
        finally:
            for p in pumps:
                p.cancel()


def _joined(a: dict[str, Any], b: dict[str, Any] | None) -> dict[str, Any]:
    if b is None:
        return a
    return {key: a[key] + b[key] for key in a}


async def _newest(
    single: asyncio.Queue[RequestOutput], merged: asyncio.Queue[tuple[int, RequestOutput]] | None
) -> dict[int, RequestOutput]:
    """The newest snapshot of each choice with new output, waiting for one. Everything queued
    since the last call is taken at once: a snapshot holds all of its request's output so far, so
    a consumer that fell behind by several steps sends one chunk for them, not one per step (at
    hundreds of streams the event loop's cost per chunk is what falls behind)."""
    if merged is None:
        out = await single.get()
        while not single.empty():
            out = single.get_nowait()
        return {0: out}
    i, out = await merged.get()
    newest = {i: out}
    while not merged.empty():
        i, out = merged.get_nowait()
        newest[i] = out
    return newest


async def _pump(
    index: int, source: asyncio.Queue[RequestOutput], sink: asyncio.Queue[tuple[int, RequestOutput]]
) -> None:
    while True:
        out = await source.get()
        await sink.put((index, out))
        if out.finished:
            return


def _usage(runs: list[ChoiceRun], finals: list[RequestOutput]) -> dict[str, int]:
    prompt_tokens = 0
    seen_prompts: set[int] = set()
    for run, out in zip(runs, finals, strict=True):
        key = id(run.prompt)
        if key not in seen_prompts:  # n choices of one prompt count its tokens once
            seen_prompts.add(key)
            prompt_tokens += len(out.prompt_token_ids)
    completion = sum(len(out.token_ids) for out in finals)
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion,
        "total_tokens": prompt_tokens + completion,
    }
