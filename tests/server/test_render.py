"""Streaming text never takes back what it sent, and never sends the start of a stop string."""

from __future__ import annotations

from loraplex.server.render import TextStreamer


def stream_all(stop: tuple[str, ...], snapshots: list[str], final: str) -> str:
    streamer = TextStreamer(stop)
    out = "".join(streamer.delta(text, finished=False) for text in snapshots)
    return out + streamer.delta(final, finished=True)


def test_no_stop_strings_stream_everything_at_once() -> None:
    streamer = TextStreamer(())
    assert streamer.delta("ab", False) == "ab"
    assert streamer.delta("abc", False) == "c"
    assert streamer.delta("abc", True) == ""


def test_holds_back_a_possible_stop_prefix() -> None:
    streamer = TextStreamer(("END",))
    assert streamer.delta("abcE", False) == "ab"  # "cE" could still become "END"... or not
    assert streamer.delta("abcEN", False) == "c"
    # the engine cut the stop string: the final text is shorter than what was seen
    assert streamer.delta("abc", True) == ""


def test_concatenated_deltas_equal_the_final_text() -> None:
    snapshots = ["h", "he", "hel", "hell", "hello", "hello ", "hello w"]
    assert stream_all(("xyz",), snapshots, "hello world") == "hello world"
    assert stream_all((), snapshots, "hello world") == "hello world"


def test_incomplete_multibyte_character_is_held() -> None:
    streamer = TextStreamer(())
    assert streamer.delta("caf\ufffd", False) == "caf"
    assert streamer.delta("café", True) == "é"


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
    body = {"gen": renderer.completion_logprobs(out, 0, 0), "prompt": renderer.prompt_logprobs(out)}
    text = json.dumps(body, allow_nan=False)  # raises on any NaN or Infinity
    assert body["gen"]["token_logprobs"] == [LOGPROB_FLOOR]
    assert body["prompt"]["token_logprobs"] == [None, LOGPROB_FLOOR]
    assert "NaN" not in text and "Infinity" not in text and LOGPROB_FLOOR == -9999.0
