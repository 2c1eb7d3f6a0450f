"""Streaming text never takes back what it sent, and never sends the start of a stop string."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from loraplex.server.deltas import Cursor, OutputDelta
from loraplex.server.render import TextStreamer
from loraplex.types import RequestOutput


class SnapshotStreamer:
    """A TextStreamer fed the request's whole text per step, turned into deltas as the engine
    thread does (`Cursor`)."""

    def __init__(self, stop: tuple[str, ...]) -> None:
        self.streamer = TextStreamer(stop)
        self.cursor = Cursor()

    def delta(self, text: str, finished: bool) -> str:
        d = self.cursor.advance([], text, None, finished, None)
        return self.streamer.feed(d.text_start, d.text, finished)


def stream_all(stop: tuple[str, ...], snapshots: list[str], final: str) -> str:
    streamer = SnapshotStreamer(stop)
    out = "".join(streamer.delta(text, finished=False) for text in snapshots)
    return out + streamer.delta(final, finished=True)


def test_no_stop_strings_stream_everything_at_once() -> None:
    streamer = SnapshotStreamer(())
    assert streamer.delta("ab", False) == "ab"
    assert streamer.delta("abc", False) == "c"
    assert streamer.delta("abc", True) == ""


def test_holds_back_a_possible_stop_prefix() -> None:
    streamer = SnapshotStreamer(("END",))
    assert streamer.delta("abcE", False) == "ab"  # "cE" could still become "END"... or not
    assert streamer.delta("abcEN", False) == "c"
    # the engine cut the stop string: the final text is shorter than what was seen
    assert streamer.delta("abc", True) == ""


def test_a_cut_into_text_held_back_over_several_deltas() -> None:
    streamer = SnapshotStreamer(("xyz",))
    assert streamer.delta("ab", False) == ""
    assert streamer.delta("abcx", False) == "ab"
    assert streamer.delta("abcxy", False) == "c"
    assert streamer.delta("abc", True) == ""  # "xyz" completed and was cut at "x"
    assert streamer.streamer.sent == 3


def test_concatenated_deltas_equal_the_final_text() -> None:
    snapshots = ["h", "he", "hel", "hell", "hello", "hello ", "hello w"]
    assert stream_all(("xyz",), snapshots, "hello world") == "hello world"
    assert stream_all((), snapshots, "hello world") == "hello world"


def test_incomplete_multibyte_character_is_held() -> None:
    streamer = TextStreamer(())
    assert streamer.feed(0, "caf\ufffd", False) == "caf"
    assert streamer.feed(3, "é", True) == "é"  # a delta that replaces the held-back tail


def test_logprobs_render_finite() -> None:
    import json
    import math

    from loraplex.server.render import LOGPROB_FLOOR, Renderer
    from loraplex.types import RequestOutput

    out = RequestOutput(
        request_id="r",
        prompt_token_ids=[5, 6],
        adapter=None,
        token_ids=[7],
        logprobs=[{7: -math.inf, 8: -0.5, 9: math.nan}],
        prompt_logprobs=[None, {6: -math.inf}],
    )
    renderer = Renderer(None, "m")
    body = {
        "gen": renderer.completion_logprobs(out.token_ids, out.logprobs, 0),
        "prompt": renderer.prompt_logprobs(out.prompt_token_ids, out.prompt_logprobs),
    }
    text = json.dumps(body, allow_nan=False)  # raises on any NaN or Infinity
    assert body["gen"]["token_logprobs"] == [LOGPROB_FLOOR]
    assert body["prompt"]["token_logprobs"] == [None, LOGPROB_FLOOR]
    assert "NaN" not in text and "Infinity" not in text and LOGPROB_FLOOR == -9999.0


def _deltas(words: list[str], logprobs: bool) -> list[OutputDelta]:
    """The deltas the step thread queues for one request, one per step, the last finished."""
    cursor = Cursor()
    outs = []
    for n in range(1, len(words) + 1):
        ids = list(range(10, 10 + n))
        outs.append(
            cursor.of_output(
                RequestOutput(
                    request_id="r",
                    prompt_token_ids=[5],
                    adapter=None,
                    token_ids=ids,
                    text=" ".join(words[:n]),
                    logprobs=[{t: -0.5} for t in ids] if logprobs else None,
                    finished=n == len(words),
                    finish_reason="length" if n == len(words) else None,
                )
            )
        )
    return outs


def _render(outs: list[OutputDelta], queued_before_reading: int, logprobs: bool) -> list[dict[str, Any]]:
    """Stream `outs` through the renderer: the first `queued_before_reading` are already queued
    when it starts reading (a consumer behind the step thread), the others come one at a time."""
    from loraplex.server.choices import ChoiceRun
    from loraplex.server.render import Renderer
    from loraplex.types import SamplingParams

    async def go() -> list[dict[str, Any]]:
        fed = queued_before_reading
        queue: asyncio.Queue[OutputDelta] = asyncio.Queue()
        for out in outs[:fed]:
            queue.put_nowait(out)
        params = SamplingParams(max_tokens=len(outs), logprobs=0 if logprobs else None)
        run = ChoiceRun(0, [5], params)
        chunks = []
        async for chunk in Renderer(None, "m").stream("cmpl-x", "m", [run], [queue], False, True):
            chunks.append(chunk)
            if len(outs) > fed and not queue.qsize():
                queue.put_nowait(outs[fed])
                fed += 1
        return chunks

    return asyncio.run(go())


@pytest.mark.parametrize("logprobs", [False, True])
def test_a_consumer_behind_sends_one_chunk_for_the_deltas_queued_and_the_same_output(
    logprobs: bool,
) -> None:
    words = ["a", "bb", "c", "dd", "e", "ff"]
    outs = _deltas(words, logprobs)
    one_by_one = _render(outs, 1, logprobs)
    behind = _render(outs, 4, logprobs)  # four steps' snapshots waiting when it first reads
    for chunks in (one_by_one, behind):
        texts = [c["choices"][0]["text"] for c in chunks if c["choices"]]
        assert "".join(texts) == " ".join(words)
        assert chunks[-1]["usage"]["completion_tokens"] == len(words)
        if logprobs:
            tokens = [t for c in chunks if c["choices"] for t in c["choices"][0]["logprobs"]["tokens"]]
            assert len(tokens) == len(words)
    assert len(one_by_one) == len(words) + 1  # a chunk per step, then the usage
    assert len(behind) == len(words) - 3 + 1  # the four queued deltas went out as one chunk
