"""The engine thread hands streams per-step deltas: what a stream sends, joined, is exactly the
non-streamed response (greedy, on the demo model), with and without stop strings and logprobs, and
also for a reader that fell many steps behind (every delta it missed joined into one chunk)."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx
import pytest
from helpers.live_server import live_server

from loraplex.demo import DEMO_ADAPTERS, DEMO_MODEL_DIR
from loraplex.demo.tasks import TASKS, held_out_inputs, make_prompt
from loraplex.server.async_engine import AsyncEngine
from loraplex.server.choices import ChoiceRun
from loraplex.server.deltas import OutputDelta
from loraplex.server.render import Renderer
from loraplex.types import SamplingParams

BASE = "loraplex-demo"
INPUTS = [t for t in held_out_inputs(40, seed=7) if len(t) >= 8][:3]


@pytest.fixture(scope="module")
def server():  # noqa: ANN201
    adapters = {name: str(path) for name, path in DEMO_ADAPTERS.items()}
    with live_server(str(DEMO_MODEL_DIR), adapters) as (base_url, srv):
        yield base_url, srv


def _stops(answer: str) -> dict[str, list[str] | None]:
    """Stop strings against the answer: none; one that completes mid-answer and straddles two
    steps (the cut falls into text the stream held back); one that starts like the answer and
    never completes (held back, then released)."""
    return {"none": None, "straddling": [answer[3:6]], "near_miss": [answer[2:4] + "#", "~~~"]}


def _sse(client: httpx.Client, path: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    chunks = []
    with client.stream("POST", path, json={**body, "stream": True}) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunks.append(json.loads(line[len("data: ") :]))
    return chunks


def _joined_completion(chunks: list[dict[str, Any]], index: int) -> dict[str, Any]:
    """One choice of a streamed completion put back together: text, logprobs, finish reason."""
    text, reason = "", None
    logprobs: dict[str, list[Any]] | None = None
    for chunk in chunks:
        for choice in chunk["choices"]:
            if choice["index"] != index:
                continue
            text += choice["text"]
            reason = choice["finish_reason"] or reason
            if choice["logprobs"] is not None:
                logprobs = logprobs or {
                    "tokens": [],
                    "token_logprobs": [],
                    "top_logprobs": [],
                    "text_offset": [],
                }
                for key in logprobs:
                    logprobs[key] += choice["logprobs"][key]
    return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": reason}


@pytest.mark.parametrize("logprobs", [None, 2])
@pytest.mark.parametrize("stop_kind", ["none", "straddling", "near_miss"])
@pytest.mark.parametrize("model", [BASE, "reverse"])
def test_streamed_completion_joins_to_the_full_response(
    server,
    model: str,
    stop_kind: str,
    logprobs: int | None,  # noqa: ANN001
) -> None:
    with httpx.Client(base_url=server[0], timeout=60) as client:
        for text in INPUTS:
            answer = TASKS["copy" if model == BASE else model](text)
            body = {
                "model": model,
                "prompt": make_prompt(text),
                "max_tokens": 24,
                "temperature": 0,
                "n": 2,
                "logprobs": logprobs,
                "stop": _stops(answer)[stop_kind],
            }
            full = client.post("/v1/completions", json=body).json()
            chunks = _sse(client, "/v1/completions", {**body, "stream_options": {"include_usage": True}})
            for choice in full["choices"]:
                assert _joined_completion(chunks, choice["index"]) == choice
            assert chunks[-1]["usage"] == full["usage"]
            if stop_kind == "straddling":  # the stop string was cut, and nothing of it went out
                cut = answer.index(answer[3:6])
                assert (
                    full["choices"][0]["text"] == answer[:cut]
                    and full["choices"][0]["finish_reason"] == "stop"
                )


@pytest.mark.parametrize("stop_kind", ["none", "straddling"])
def test_streamed_chat_joins_to_the_full_response(server, stop_kind: str) -> None:  # noqa: ANN001
    with httpx.Client(base_url=server[0], timeout=60) as client:
        for text in INPUTS:
            body = {
                "model": "upper",
                "messages": [{"role": "user", "content": text}],
                "max_tokens": 24,
                "temperature": 0,
                "logprobs": True,
                "top_logprobs": 2,
                "stop": _stops(text.upper())[stop_kind],
            }
            full = client.post("/v1/chat/completions", json=body).json()["choices"][0]
            chunks = _sse(client, "/v1/chat/completions", body)
            choices = [c for chunk in chunks for c in chunk["choices"]]
            content = "".join(c["delta"].get("content", "") for c in choices)
            lps = [entry for c in choices if c["logprobs"] for entry in c["logprobs"]["content"]]
            assert content == full["message"]["content"]
            assert lps == full["logprobs"]["content"]
            assert choices[-1]["finish_reason"] == full["finish_reason"]


async def _finished_unread(
    async_engine: AsyncEngine, runs: list[ChoiceRun], request_id: str, adapter: str | None
) -> list[asyncio.Queue[OutputDelta]]:
    """Admit the runs and let them finish with nobody reading: every step's delta stays queued."""

    def gone(engine: Any, rid: str) -> bool:  # noqa: ANN401
        try:
            engine.sequence(rid)
        except KeyError:
            return True
        return False

    queues = await async_engine.add_many(
        [(run.request_id(request_id), run.prompt, run.params) for run in runs], adapter
    )
    for run in runs:  # released by the step that finished it, after its delta was handed over
        rid = run.request_id(request_id)
        while not await asyncio.wrap_future(async_engine.call(lambda e, rid=rid: gone(e, rid))):
            await asyncio.sleep(0.01)
    await asyncio.sleep(0.05)  # the hand-off's callbacks run on this loop
    return queues


@pytest.mark.parametrize("stop_kind", ["none", "straddling"])
def test_a_reader_many_steps_behind_gets_the_same_output(server, stop_kind: str) -> None:  # noqa: ANN001
    base_url, srv = server
    async_engine: AsyncEngine = srv.async_engine
    tokenizer = async_engine.engine.tokenizer
    text = INPUTS[0]
    prompt = tokenizer(make_prompt(text), add_special_tokens=False)["input_ids"]
    stop = _stops(text[::-1])[stop_kind]
    params = SamplingParams(max_tokens=24, temperature=0, logprobs=2, stop=tuple(stop or ()))
    runs = [ChoiceRun(0, prompt, params), ChoiceRun(1, prompt, params)]
    body = {"model": "reverse", "prompt": prompt, "max_tokens": 24, "temperature": 0, "logprobs": 2, "n": 2}
    with httpx.Client(base_url=base_url, timeout=60) as client:
        full = client.post("/v1/completions", json={**body, "stop": stop}).json()

    async def behind(these: list[ChoiceRun], request_id: str) -> list[dict[str, Any]]:
        queues = await _finished_unread(async_engine, these, request_id, "reverse")
        assert all(q.qsize() >= len(text) // 2 for q in queues)  # many steps' deltas wait
        renderer = Renderer(tokenizer, "m")
        return [c async for c in renderer.stream(request_id, "reverse", these, queues, False, True)]

    # Several choices (merged by pump tasks) and one alone (its queue read directly).
    for these in (runs, runs[:1]):
        chunks = asyncio.run(behind(these, f"cmpl-behind-{stop_kind}-{len(these)}"))
        for run in these:
            got, want = _joined_completion(chunks, run.index), full["choices"][run.index]
            assert got["text"] == want["text"] and got["finish_reason"] == want["finish_reason"]
            for key in ("tokens", "text_offset"):
                assert got["logprobs"][key] == want["logprobs"][key]
            # Values agree to rounding only: the batch the rows ran in differs from the HTTP run's.
            assert got["logprobs"]["token_logprobs"] == pytest.approx(
                want["logprobs"]["token_logprobs"], abs=1e-3
            )
        if len(these) == 1:  # everything it missed went out as one chunk, then the usage
            assert len(chunks) == 2
            assert chunks[-1]["usage"]["completion_tokens"] == full["usage"]["completion_tokens"] // 2
