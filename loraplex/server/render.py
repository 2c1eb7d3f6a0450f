"""Engine outputs -> OpenAI response bodies and stream chunks."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Sequence
from typing import Any

from loraplex.server.choices import ChoiceRun
from loraplex.server.protocol import APIError, ChatMessage
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


class Renderer:
    def __init__(self, tokenizer: Any, served_model: str) -> None:
        self.tokenizer = tokenizer
        self.served_model = served_model

    # --- prompts --------------------------------------------------------------------------------

    def chat_prompt(self, messages: list[ChatMessage]) -> str:
        if self.tokenizer is None or not getattr(self.tokenizer, "chat_template", None):
            raise APIError(400, "this model has no chat template; use /v1/completions")
        rendered = [{"role": m.role, "content": m.content or ""} for m in messages]
        try:
            return self.tokenizer.apply_chat_template(rendered, tokenize=False, add_generation_prompt=True)
        except Exception as err:  # a template may reject a conversation (e.g. role order)
            raise APIError(400, f"chat template rejected the messages: {err}", param="messages") from None

    def token_text(self, token_id: int) -> str:
        return "" if self.tokenizer is None else self.tokenizer.decode([token_id])

    # --- logprobs -------------------------------------------------------------------------------

    def completion_logprobs(self, out: RequestOutput, start: int, offset: int) -> dict[str, Any] | None:
        if out.logprobs is None:
            return None
        tokens, token_lps, tops, offsets = [], [], [], []
        for i in range(start, len(out.token_ids)):
            tid, lps = out.token_ids[i], out.logprobs[i]
            text = self.token_text(tid)
            tokens.append(text)
            token_lps.append(lps[tid])
            tops.append({self.token_text(t): lp for t, lp in lps.items()})
            offsets.append(offset)
            offset += len(text)
        return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}

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
                    "logprob": lps[tid],
                    "bytes": list(self.token_text(tid).encode()),
                    "top_logprobs": [
                        {
                            "token": self.token_text(t),
                            "logprob": lp,
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
                        "text": out.text,
                        "logprobs": self.completion_logprobs(out, 0, 0),
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
        merged: asyncio.Queue[tuple[int, RequestOutput]] = asyncio.Queue()
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
            while any(f is None for f in finals):
                i, out = await merged.get()
                run = runs[i]
                text = streamers[i].delta(out.text, out.finished)
                if chat:
                    lp = self.chat_logprobs(out, tokens_sent[i], run.params.logprobs or 0)
                    choice = {"index": run.index, "delta": {"content": text} if text else {}, "logprobs": lp}
                else:
                    offset = streamers[i].sent - len(text)
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


async def _pump(index: int, source: asyncio.Queue[RequestOutput], sink: asyncio.Queue) -> None:
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
