"""Hostile and malformed requests get a 4xx with OpenAI's error JSON naming the parameter, cost the
engine nothing, and leave the connection and every other request intact."""

from __future__ import annotations

import json

import httpx
import pytest
from helpers.live_server import live_server

from loraplex.demo import DEMO_ADAPTERS, DEMO_MODEL_DIR
from loraplex.demo.tasks import make_prompt

BASE = "loraplex-demo"
GOOD = {"model": "reverse", "prompt": "hello=", "max_tokens": 20, "temperature": 0}


@pytest.fixture(scope="module")
def server():  # noqa: ANN201
    adapters = {name: str(path) for name, path in DEMO_ADAPTERS.items()}
    with live_server(str(DEMO_MODEL_DIR), adapters) as (base_url, srv):
        yield base_url, srv


def _error(resp: httpx.Response, status: int, param: str | None = "any") -> dict:
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert isinstance(err["message"], str) and err["message"] and err["type"]
    if param != "any":
        assert err["param"] == param, err
    return err


def _post_raw(client: httpx.Client, path: str, raw: str | bytes) -> httpx.Response:
    data = raw.encode() if isinstance(raw, str) else raw
    return client.post(path, content=data, headers={"content-type": "application/json"})


@pytest.mark.parametrize(
    ("route", "body", "param"),
    [
        ("/v1/completions", '{"model": "loraplex-demo", "prompt": "\\ud800abc="}', "prompt"),
        ("/v1/completions", '{"model": "loraplex-demo", "prompt": ["ok=", "x\\udfffy="]}', "prompt"),
        (
            "/v1/chat/completions",
            '{"model": "loraplex-demo", "messages": [{"role": "user", "content": "a\\ud83d"}]}',
            "messages",
        ),
        (
            "/v1/chat/completions",
            '{"model": "loraplex-demo", "messages": [{"role": "user", '
            '"content": [{"type": "text", "text": "\\udc00"}]}]}',
            "messages",
        ),
    ],
)
def test_lone_surrogates_are_a_400_and_the_connection_stays_usable(
    server, route: str, body: str, param: str
) -> None:  # noqa: ANN001
    with httpx.Client(base_url=server[0], timeout=30) as client:
        err = _error(_post_raw(client, route, body), 400, param)
        assert "surrogate" in err["message"]
        # the same keep-alive connection serves the next request
        assert client.post("/v1/completions", json=GOOD).json()["choices"][0]["text"] == "olleh"


@pytest.mark.parametrize("field", ["temperature", "top_p", "presence_penalty", "frequency_penalty"])
@pytest.mark.parametrize("literal", ["NaN", "Infinity", "-Infinity", "1e999", "-1e999"])
def test_non_finite_numbers_are_refused_for_every_float_field(server, field: str, literal: str) -> None:  # noqa: ANN001
    for route, extra in (
        ("/v1/completions", '"prompt": "abc="'),
        ("/v1/chat/completions", '"messages": [{"role": "user", "content": "abc"}]'),
    ):
        raw = f'{{"model": "{BASE}", {extra}, "{field}": {literal}}}'
        resp = httpx.post(server[0] + route, content=raw, headers={"content-type": "application/json"})
        _error(resp, 400)
    raw = f'{{"model": "{BASE}", "prompt": "abc=", "logit_bias": {{"5": {literal}}}}}'
    resp = httpx.post(
        server[0] + "/v1/completions", content=raw, headers={"content-type": "application/json"}
    )
    _error(resp, 400)


@pytest.mark.parametrize(
    ("override", "param"),
    [
        ({"n": "2"}, "n"),
        ({"stream": "true"}, "stream"),
        ({"max_tokens": "5"}, "max_tokens"),
        ({"max_tokens": 5.0}, "max_tokens"),
        ({"temperature": True}, "temperature"),
        ({"temperature": "0"}, "temperature"),
        ({"temperature": 1e300}, "temperature"),
        ({"logprobs": True}, "logprobs"),
        ({"echo": 1}, "echo"),
        ({"seed": 2**70}, "seed"),
        ({"model": 5}, "model"),
        ({"prompt": ["abc=", 5]}, "prompt"),
        ({"stream_options": {"include_usage": "yes"}}, "stream_options"),
    ],
)
def test_strict_types(server, override: dict, param: str) -> None:  # noqa: ANN001
    resp = httpx.post(server[0] + "/v1/completions", json={**GOOD, **override})
    _error(resp, 400, param)


def test_deep_nesting_and_malformed_bodies_are_400(server) -> None:  # noqa: ANN001
    with httpx.Client(base_url=server[0], timeout=30) as client:
        for raw in (
            "[" * 100_000,
            '{"model": "loraplex-demo", "prompt": ' + "[" * 100_000 + "]" * 100_000 + "}",
            '{"model": "loraplex-demo", "prompt": "abc=", "user": ' + '{"a":' * 5000 + "1" + "}" * 5001,
            b"\xff\xfe{}",
            "",
            "[1, 2]",
            '"just a string"',
            '{"model": "loraplex-demo", "prompt": "abc=", "seed": ' + "9" * 10_000 + "}",
        ):
            _error(_post_raw(client, "/v1/completions", raw), 400)
            _error(_post_raw(client, "/v1/chat/completions", raw), 400)
        assert client.post("/v1/completions", json=GOOD).json()["choices"][0]["text"] == "olleh"


def test_request_shaped_limits_name_their_parameter(server) -> None:  # noqa: ANN001
    url = server[0] + "/v1/completions"
    chat = server[0] + "/v1/chat/completions"
    msgs = [{"role": "user", "content": "abc"}]
    _error(httpx.post(url, json={**GOOD, "n": 129}), 400, "n")
    _error(httpx.post(url, json={**GOOD, "prompt": ["a="] * 65, "n": 2}), 400, "prompt")
    _error(httpx.post(url, json={**GOOD, "stop": ["x"] * 17}), 400, "stop")
    _error(httpx.post(url, json={**GOOD, "stop": "x" * 257}), 400, "stop")
    _error(httpx.post(url, json={**GOOD, "stop": [f"s{i}" for i in range(10_000)]}), 400, "stop")
    _error(httpx.post(url, json={**GOOD, "logprobs": 21}), 400, "logprobs")
    _error(
        httpx.post(chat, json={"model": BASE, "messages": msgs, "logprobs": True, "top_logprobs": 21}), 400
    )
    # at the limits: accepted
    ok = httpx.post(url, json={**GOOD, "prompt": ["a="] * 64, "n": 2, "max_tokens": 2, "stop": ["x"] * 16})
    assert ok.status_code == 200 and len(ok.json()["choices"]) == 128
    assert httpx.post(url, json={**GOOD, "stop": "x" * 256, "logprobs": 20}).status_code == 200
    top = {"model": BASE, "messages": msgs, "max_tokens": 2, "logprobs": True, "top_logprobs": 20}
    assert httpx.post(chat, json=top).status_code == 200


def test_max_tokens_semantics(server) -> None:  # noqa: ANN001
    base_url, srv = server
    context = srv.async_engine.engine.max_model_len
    url = base_url + "/v1/completions"
    long_input = "ab" * 20  # 41 prompt tokens with '='
    for huge in (10**9, 2**70, context):
        err = _error(httpx.post(url, json={**GOOD, "max_tokens": huge}), 400, "max_tokens")
        assert "context" in err["message"]
    # omitted: 16 on completions (the legacy default), clamped to the room left in the context
    body = {"model": BASE, "prompt": long_input + "=", "temperature": 0, "ignore_eos": True}
    out = httpx.post(url, json=body).json()
    assert out["usage"]["completion_tokens"] == 16
    full = {**body, "prompt": "a" * (context - 6) + "="}
    assert httpx.post(url, json=full).json()["usage"]["completion_tokens"] == 5
    # prompt + max_tokens exactly the context: accepted; one more: refused
    assert httpx.post(url, json={**full, "max_tokens": 5}).status_code == 200
    _error(httpx.post(url, json={**full, "max_tokens": 6}), 400, "max_tokens")
    _error(httpx.post(url, json={**GOOD, "max_tokens": 0}), 400, "max_tokens")
    # chat, omitted: the rest of the context
    chat = httpx.post(
        base_url + "/v1/chat/completions",
        json={"model": BASE, "messages": [{"role": "user", "content": "abc"}], "ignore_eos": True},
    ).json()
    assert chat["usage"]["completion_tokens"] == context - len("abc=")


def test_prompt_too_long_is_refused_before_tokenizing(server) -> None:  # noqa: ANN001
    base_url, srv = server
    refused_before = _refused(base_url)
    big = "a" * 1_000_000
    err = _error(httpx.post(base_url + "/v1/completions", json={"model": BASE, "prompt": big}), 400, "prompt")
    assert "characters" in err["message"]
    err = _error(
        httpx.post(
            base_url + "/v1/chat/completions",
            json={"model": BASE, "messages": [{"role": "user", "content": big}]},
        ),
        400,
        "messages",
    )
    assert _refused(base_url) == refused_before + 2
    assert srv.async_engine.engine.scheduler.has_work() is False


def _refused(base_url: str) -> float:
    text = httpx.get(base_url + "/metrics").text
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("loraplex_requests_refused_total{")
    )


def test_model_retrieve_and_pinned_revisions(server) -> None:  # noqa: ANN001
    import openai

    client = openai.OpenAI(base_url=server[0] + "/v1", api_key="x", max_retries=0)
    base = client.models.retrieve(BASE)
    assert base.id == BASE
    rev = client.models.retrieve("upper").model_extra["revision"]
    pinned = client.models.retrieve(f"upper@{rev[:10]}")
    assert pinned.id == f"upper@{rev[:10]}" and pinned.model_extra["revision"] == rev
    for missing in ("nope", "upper@ffffff", "a/b/c", "upper@", "../../etc/passwd"):
        with pytest.raises(openai.NotFoundError):
            client.models.retrieve(missing)
    resp = httpx.get(server[0] + "/v1/models/upper@")
    assert "empty" in _error(resp, 404, "model")["message"]
    done = httpx.post(server[0] + "/v1/completions", json={**GOOD, "model": "reverse@"})
    assert "empty" in _error(done, 404, "model")["message"]


def test_openapi_describes_what_the_server_returns(server) -> None:  # noqa: ANN001
    schema = httpx.get(server[0] + "/openapi.json").json()
    text = json.dumps(schema)
    assert '"422"' not in text and "HTTPValidationError" not in text
    for path in ("/v1/completions", "/v1/chat/completions"):
        op = schema["paths"][path]["post"]
        assert {"200", "400", "401", "404", "413", "429"} <= set(op["responses"])
        ref = op["requestBody"]["content"]["application/json"]["schema"]["$ref"]
        name = ref.rsplit("/", 1)[1]
        assert "model" in schema["components"]["schemas"][name]["properties"]
    assert "/v1/models/{model_id}" in schema["paths"]
    # the documented 400 is what a validation error really returns
    _error(httpx.post(server[0] + "/v1/completions", json={"model": BASE}), 400, "prompt")


def test_responses_never_carry_nan_or_infinity(server) -> None:  # noqa: ANN001
    # top-20 logprobs of a 99-token vocabulary reach tokens the model all but rules out
    body = {**GOOD, "model": BASE, "prompt": make_prompt("abc"), "logprobs": 20, "echo": True}

    def no_constants(name: str) -> None:
        raise AssertionError(f"{name} in a response")

    text = httpx.post(server[0] + "/v1/completions", json=body).text
    json.loads(text, parse_constant=no_constants)
    with httpx.stream("POST", server[0] + "/v1/completions", json={**body, "stream": True}) as resp:
        for line in resp.iter_lines():
            if line.startswith("data: {"):
                json.loads(line[6:], parse_constant=no_constants)
