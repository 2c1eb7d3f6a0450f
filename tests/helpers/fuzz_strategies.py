"""Hypothesis strategies for fuzzing the HTTP server (tests/server/test_fuzz.py): request-like
bodies, any JSON value, raw bytes, GET targets; with the demo model's names and prompts."""

from __future__ import annotations

import json
import math
from typing import Any
from urllib.parse import quote

from hypothesis import strategies as st

from loraplex.demo import DEMO_ADAPTERS
from loraplex.demo.tasks import ALPHABET, make_prompt

BASE = "loraplex-demo"
MODELS = [BASE, *DEMO_ADAPTERS]
POST_PATHS = ["/v1/completions", "/v1/chat/completions"]
MIB = 1024 * 1024


def dumps(value: Any) -> bytes:  # noqa: ANN401
    """JSON as a client might send it: NaN and Infinity written as such, a lone surrogate as its
    \\ud800 escape."""
    return json.dumps(value, allow_nan=True, ensure_ascii=True).encode("ascii")


SURROGATES = st.integers(0xD800, 0xDFFF).map(chr)
ODD_CHARS = st.sampled_from(
    [chr(c) for c in range(32)] + ["\x7f", "\x85", "\u2028", "\ufeff", "\ufffe", "\uffff", "\U0010ffff"]
)
SHORT_TEXT = st.lists(st.one_of(st.characters(), SURROGATES, ODD_CHARS), max_size=12).map("".join)
LONG_TEXT = st.builds(
    lambda char, count: char * count,
    st.sampled_from(["a", "=", "é", "\U0001f600", "\x00", "\ud800", "ab\udfff"]),
    st.sampled_from([257, 5_000, 70_000, 600_000]),
)
TEXT = st.one_of(SHORT_TEXT, SHORT_TEXT, SHORT_TEXT, LONG_TEXT)
DEMO_INPUT = st.text(alphabet=ALPHABET, min_size=1, max_size=16)
DEMO_PROMPT = DEMO_INPUT.map(make_prompt)

HUGE_INTS = st.sampled_from([2**31, 2**63, 2**64, 2**70, -(2**63) - 1, -(2**70), 10**300])
INTS = st.one_of(st.integers(), HUGE_INTS)
FLOATS = st.one_of(
    st.floats(), st.sampled_from([math.nan, math.inf, -math.inf, -0.0, 5e-324, 1.7976931348623157e308])
)
REQUEST_KEYS = [
    "model", "prompt", "messages", "max_tokens", "temperature", "top_p", "n", "stop", "logprobs",
    "top_logprobs", "echo", "stream", "stream_options", "seed", "top_k", "ignore_eos", "role",
    "content", "type", "text", "include_usage",
]  # fmt: skip
KEYS = st.one_of(st.sampled_from(REQUEST_KEYS), SHORT_TEXT)
SCALARS = st.one_of(st.none(), st.booleans(), INTS, FLOATS, TEXT)
JSON_VALUES = st.recursive(
    SCALARS,
    lambda children: st.one_of(st.lists(children, max_size=4), st.dictionaries(KEYS, children, max_size=4)),
    max_leaves=12,
)


def maybe_junk(strategy: st.SearchStrategy) -> st.SearchStrategy:
    """Mostly `strategy`, sometimes any JSON value."""
    return st.one_of(strategy, strategy, strategy, JSON_VALUES)


BAD_MODELS = [
    "", "nope", "Reverse", "reverse ", " reverse", "reverse@", "reverse@" + "0" * 64, "reverse@latest",
    "@", "reverse@@", "../reverse", "/etc/passwd", str(DEMO_ADAPTERS["reverse"]), "http://127.0.0.1/x",
    "reverse\x00", "\ud800", f"{BASE}@abc", "a" * 300, "reverse/../upper",
]  # fmt: skip
MODEL = st.one_of(st.sampled_from(MODELS), st.sampled_from(MODELS), st.sampled_from(BAD_MODELS), JSON_VALUES)

TOKEN_ID = st.one_of(st.integers(0, 98), st.integers(0, 98), st.sampled_from([-1, 99, 100, 2**31, 2**70]))
TOKEN_IDS = st.lists(TOKEN_ID, max_size=8)
PROMPT = st.one_of(
    DEMO_PROMPT,
    DEMO_PROMPT,
    TEXT,
    st.lists(st.one_of(DEMO_PROMPT, DEMO_PROMPT, TEXT, TOKEN_IDS), max_size=4),
    TOKEN_IDS,
    st.lists(TOKEN_IDS, max_size=3),
    JSON_VALUES,
)

CONTENT_PART = st.fixed_dictionaries(
    {"type": maybe_junk(st.sampled_from(["text", "image_url", "input_audio", ""]))},
    optional={"text": st.one_of(DEMO_INPUT, TEXT, JSON_VALUES), "image_url": JSON_VALUES},
)
MESSAGE = st.fixed_dictionaries(
    {
        "role": maybe_junk(
            st.sampled_from(["user", "system", "assistant", "developer", "tool", "function", "USER"])
        )
    },
    optional={
        "content": st.one_of(
            DEMO_INPUT, DEMO_INPUT, TEXT, st.none(), st.lists(CONTENT_PART, max_size=3), JSON_VALUES
        ),
        "name": TEXT,
        "tool_calls": JSON_VALUES,
    },
)
MESSAGES = maybe_junk(st.lists(MESSAGE, max_size=4))

SMALL_MAX_TOKENS = st.integers(1, 8)
OPTIONAL_FIELDS = {
    "max_tokens": st.one_of(
        SMALL_MAX_TOKENS,
        SMALL_MAX_TOKENS,
        SMALL_MAX_TOKENS,
        st.sampled_from([0, -1, 24, 59, 60, 64, 65, 2**31, 2**70, None, "5", 5.0, 5.5, True, math.nan]),
        JSON_VALUES,
    ),
    "temperature": st.one_of(FLOATS, st.sampled_from([0, 1, 2, -1, "0.5", None, True]), JSON_VALUES),
    "top_p": st.one_of(FLOATS, st.sampled_from([0, 1, 0.5, 1.0000001, -1, "1", None])),
    "n": st.one_of(
        st.integers(1, 3),
        st.integers(1, 3),
        st.sampled_from([0, -1, 16, 17, 128, 129, 2**70, "2", 2.0, True]),
    ),
    "stop": st.one_of(
        st.none(),
        SHORT_TEXT,
        st.lists(SHORT_TEXT, max_size=20),
        st.sampled_from(["a" * 257, ["x"] * 17, "", [""], "=", "\n", ["a", "b"]]),
        JSON_VALUES,
    ),
    "logprobs": st.one_of(st.integers(0, 25), st.booleans(), st.sampled_from([-1, 2**70, "1", None, 5.0])),
    "top_logprobs": st.one_of(st.integers(0, 25), st.sampled_from([-1, 2**70, "1", None, 5.0])),
    "echo": maybe_junk(st.booleans()),
    "stream": st.one_of(st.booleans(), st.booleans(), st.sampled_from(["true", 1, 0, "false", None])),
    "stream_options": st.one_of(
        st.none(),
        st.fixed_dictionaries({}, optional={"include_usage": maybe_junk(st.booleans())}),
        JSON_VALUES,
    ),
    "seed": st.one_of(INTS, st.sampled_from(["1", 1.5, None, math.inf])),
    "top_k": st.one_of(st.integers(-3, 120), st.sampled_from([2**70, -(2**70), "3", 1.5, None])),
    "ignore_eos": maybe_junk(st.booleans()),
    "presence_penalty": FLOATS,
    "frequency_penalty": FLOATS,
    "logit_bias": JSON_VALUES,
    "best_of": st.one_of(st.integers(-1, 3), JSON_VALUES),
    "suffix": maybe_junk(SHORT_TEXT),
    "user": maybe_junk(SHORT_TEXT),
    "stop_token_ids": maybe_junk(TOKEN_IDS),
    "max_completion_tokens": st.one_of(SMALL_MAX_TOKENS, JSON_VALUES),
    "response_format": JSON_VALUES,
    "tools": JSON_VALUES,
    "min_tokens": INTS,
    "repetition_penalty": FLOATS,
}


SENSIBLE_FIELDS = {
    "max_tokens": SMALL_MAX_TOKENS,
    "temperature": st.sampled_from([0, 0.0, 0.5, 1, 1.5]),
    "top_p": st.sampled_from([0.3, 0.9, 1]),
    "n": st.integers(1, 3),
    "stop": st.one_of(st.sampled_from(["a", "e", " ", "\n"]), st.lists(DEMO_INPUT, max_size=3)),
    "stream": st.booleans(),
    "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}),
    "seed": st.integers(0, 2**31),
    "top_k": st.integers(0, 50),
    "ignore_eos": st.booleans(),
    "user": DEMO_INPUT,
}
SENSIBLE_LOGPROBS = {
    "/v1/completions": {"logprobs": st.integers(0, 5), "echo": st.just(False)},
    "/v1/chat/completions": {"logprobs": st.booleans(), "top_logprobs": st.integers(0, 5)},
}


GOOD_TOKEN_IDS = st.lists(st.integers(4, 98), min_size=1, max_size=12)
GOOD_PROMPT = st.one_of(
    DEMO_PROMPT,
    DEMO_PROMPT,
    st.lists(DEMO_PROMPT, min_size=1, max_size=3),
    GOOD_TOKEN_IDS,
    st.lists(GOOD_TOKEN_IDS, min_size=1, max_size=3),
)
GOOD_CONTENT = st.one_of(
    DEMO_INPUT,
    st.lists(st.fixed_dictionaries({"type": st.just("text"), "text": DEMO_INPUT}), min_size=1, max_size=2),
)
GOOD_MESSAGES = st.builds(
    lambda system, content: [*system, {"role": "user", "content": content}],
    st.lists(st.fixed_dictionaries({"role": st.just("system"), "content": DEMO_INPUT}), max_size=1),
    GOOD_CONTENT,
)
PERTURBATIONS = ["model", "prompt", "messages", "drop model", "drop main", "field", "field", "field", "junk"]


@st.composite
def requests(draw: st.DrawFn) -> tuple[str, Any]:
    """A body that looks like a real request to either endpoint: a real model, prompt and
    sensible fields, with a few perturbations (often none): a bad model, a bad prompt or
    messages, a required field dropped, a field with any value at all, or no object at all."""
    path = draw(st.sampled_from(POST_PATHS))
    main = "prompt" if path == "/v1/completions" else "messages"
    body: dict[str, Any] = {"model": draw(st.sampled_from(MODELS))}
    body[main] = draw(GOOD_PROMPT if main == "prompt" else GOOD_MESSAGES)
    body.update(draw(st.fixed_dictionaries({}, optional={**SENSIBLE_FIELDS, **SENSIBLE_LOGPROBS[path]})))
    for change in draw(st.lists(st.sampled_from(PERTURBATIONS), max_size=3)):
        if change == "model":
            body["model"] = draw(MODEL)
        elif change == "prompt":
            body["prompt"] = draw(PROMPT)
        elif change == "messages":
            body["messages"] = draw(MESSAGES)
        elif change == "drop model":
            body.pop("model", None)
        elif change == "drop main":
            body.pop(main, None)
        elif change == "field":
            name = draw(st.sampled_from(sorted(OPTIONAL_FIELDS)))
            body[name] = draw(OPTIONAL_FIELDS[name])
        else:
            return path, draw(JSON_VALUES)
    return path, body


def _nested(depth: int) -> bytes:
    return b'{"model": "reverse", "prompt": ' + b"[" * depth + b"1" + b"]" * depth + b"}"


GOOD = b'{"model": "reverse", "prompt": "hello=", "max_tokens": 5'
FIXED_BODIES = [
    b"",
    b" ",
    b"null",
    b"[]",
    b"{}",
    b'"x"',
    b"[" * 100_000,
    b"{" * 100_000,
    b'{"a":' * 50_000,
    _nested(31),
    _nested(33),
    _nested(5_000),
    GOOD + b"}",
    GOOD,
    GOOD + b"}}",
    GOOD + b"}\x00",
    b"\xef\xbb\xbf" + GOOD + b"}",
    (GOOD + b"}").decode().encode("utf-16"),
    (GOOD + b"}").decode().encode("utf-32"),
    GOOD + b', "temperature": NaN}',
    GOOD + b', "temperature": Infinity}',
    GOOD + b', "temperature": -Infinity}',
    GOOD + b', "temperature": 1e999}',
    GOOD + b', "temperature": -1e999}',
    GOOD + b', "top_p": nan}',
    GOOD + b', "n": 1' + b"0" * 5_000 + b"}",
    GOOD + b', "seed": 1' + b"0" * 5_000 + b"}",
    GOOD + b', "temperature": 0.' + b"0" * 5_000 + b"1}",
    GOOD + b', "max_tokens": 5}',
    b'{"model": "reverse", "prompt": "\xff\xfe="}',
    b'{"model": "reverse", "prompt": "\xc3="}',
    b'{"model": "reverse", "prompt": "\xed\xa0\x80="}',
    b'{"model": "reverse", "prompt": "\\ud800="}',
    b'{"model": "reverse", "prompt": "\\udfff\\ud800="}',
    b'{"model": "reverse", "prompt": "\\ud83d\\ude00="}',
    b'{"model": "reverse", "prompt": "\\u0000="}',
    b'{"model": "reverse", "prompt": "\\uZZZZ"}',
    b'{"model": "reverse", "prompt": "a\x00\x01="}',
    b'{"model": "reverse", "prompt": ["\\ud800=", "ab="]}',
    b'{"model": "reverse", "messages": [{"role": "user", "content": "\\ud800"}]}',
    b'{"model": "reverse", "messages": [{"role": "user", "content": [{"type": "text", "text": "\\udc00"}]}]}',
    b'{"model": "\\ud800", "prompt": "ab="}',
    b'{"model": "reverse", "prompt": "ab=", "stop": ["\\ud800"]}',
    b'{"model": "reverse", "prompt": "ab=", "n": "2"}',
    b'{"model": "reverse", "prompt": "ab=", "stream": "true"}',
    b'{"model": "reverse", "prompt": "ab=", "max_tokens": 5.0}',
    b'{"model": "reverse", "model": "upper", "prompt": "ab="}',
    b'{"model": "reverse", "prompt": "' + b"a" * (3 * MIB) + b'="}',
    b'{"model": "reverse", "prompt": "' + b"\\ud800" * (MIB // 6) + b'="}',
]


def _truncated(pair: tuple[tuple[str, Any], int]) -> bytes:
    (_, body), cut = pair
    raw = dumps(body)
    return raw[: cut % (len(raw) + 1)]


def _spliced(pair: tuple[tuple[str, Any], bytes, int]) -> bytes:
    (_, body), junk, at = pair
    raw = dumps(body)
    at %= len(raw) + 1
    return raw[:at] + junk + raw[at:]


RAW_BODIES = st.one_of(
    st.binary(max_size=64),
    st.sampled_from(FIXED_BODIES),
    st.sampled_from(FIXED_BODIES),
    st.tuples(requests(), st.integers(0, 10_000)).map(_truncated),
    st.tuples(
        requests(),
        st.sampled_from([b"\xff", b"\xc3", b"\xed\xa0\x80", b"\x00", b"\\", b'"', b"\\u"]),
        st.integers(),
    ).map(_spliced),
)
CONTENT_TYPES = st.sampled_from(
    [
        "application/json",
        "application/json",
        "application/json",
        "application/json; charset=utf-16",
        "text/plain",
        "application/x-www-form-urlencoded",
        "multipart/form-data; boundary=x",
        "",
    ]
)


GET_TARGETS = [
    "/health", "/metrics", "/openapi.json", "/v1/models", "/v1/models/", "/v1/models/reverse",
    f"/v1/models/{BASE}", "/v1/models/reverse@" + "0" * 64, "/v1/models/reverse/", "/v1/models//reverse",
    "/v1/models/%00", "/v1/models/%ff%fe", "/v1/models/%zz", "/v1/models/%", "/v1/models/%ed%a0%80",
    "/v1/models/..%2F..%2Fetc%2Fpasswd", "/v1/models/../../etc/passwd", "/v1/models/./reverse",
    "/v1/models/" + "a" * 10_000, "/v1/models/reverse?x=%ff", "/v1/completions", "/v1/chat/completions",
    "/", "//", "/v1", "/v1/", "/v1//models", "/docs", "/health?%", "/metrics/../v1/models", "/v1/models?",
    "/%2e%2e/%2e%2e/etc/passwd", "*",
]  # fmt: skip
PRINTABLE_TARGET_CHARS = "".join(chr(c) for c in range(0x21, 0x7F))
GET_PATHS = st.one_of(
    st.sampled_from(GET_TARGETS),
    st.sampled_from(GET_TARGETS),
    TEXT.map(lambda t: "/v1/models/" + quote(t.encode("utf-8", "surrogatepass")[:3000], safe="")),
    st.binary(max_size=24).map(lambda b: "/v1/models/" + quote(b, safe="/@%")),
    st.text(alphabet=PRINTABLE_TARGET_CHARS, max_size=40).map(lambda t: "/v1/models/" + t),
    st.text(alphabet=PRINTABLE_TARGET_CHARS, max_size=40).map(lambda t: "/" + t),
)
