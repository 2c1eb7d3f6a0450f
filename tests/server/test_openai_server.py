"""The OpenAI-compatible server on the demo model, through the official `openai` client and raw
HTTP: answers are checked against each adapter's task, so a request computed with another
tenant's adapter would come out visibly wrong."""

from __future__ import annotations

import concurrent.futures
import random
import re
import time

import httpx
import openai
import pytest
from helpers.live_server import live_server

from loraplex.demo import DEMO_ADAPTERS, DEMO_MODEL_DIR
from loraplex.demo.tasks import TASKS, held_out_inputs, make_prompt

BASE = "loraplex-demo"
MODEL_TASK = {BASE: "copy", **{name: name for name in DEMO_ADAPTERS}}


@pytest.fixture(scope="module")
def server():  # noqa: ANN201
    adapters = {name: str(path) for name, path in DEMO_ADAPTERS.items()}
    with live_server(str(DEMO_MODEL_DIR), adapters) as (base_url, srv):
        yield base_url, srv


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:  # noqa: ANN001
    return openai.OpenAI(base_url=server[0] + "/v1", api_key="anything", max_retries=0)


def answer(model: str, text: str) -> str:
    return TASKS[MODEL_TASK[model]](text)


INPUTS = held_out_inputs(40, seed=99)[20:]


@pytest.mark.parametrize("model", [BASE, "reverse", "upper", "sort", "caesar"])
def test_completions_and_chat_answer_the_task(client: openai.OpenAI, model: str) -> None:
    for text in INPUTS[:4]:
        want = answer(model, text)
        done = client.completions.create(model=model, prompt=make_prompt(text), max_tokens=24, temperature=0)
        assert done.choices[0].text == want and done.choices[0].finish_reason == "stop"
        assert done.usage.prompt_tokens == len(make_prompt(text))
        chat = client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": text}], max_tokens=24, temperature=0
        )
        assert chat.choices[0].message.content == want
        streamed = client.completions.create(
            model=model, prompt=make_prompt(text), max_tokens=24, temperature=0, stream=True
        )
        # the openai client's documented loop: every chunk has a choice unless usage was asked for
        assert "".join(chunk.choices[0].text for chunk in streamed) == want
        with_usage = client.completions.create(
            model=model,
            prompt=make_prompt(text),
            max_tokens=24,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
        chunks = list(with_usage)
        assert "".join(c.choices[0].text for c in chunks if c.choices) == want
        assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == len(want) + 1
        assert not chunks[-1].choices and all(c.usage is None for c in chunks[:-1])
        chat_stream = client.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": text}],
            max_tokens=24,
            temperature=0,
            stream=True,
        )
        pieces = [c.choices[0].delta.content or "" for c in chat_stream]
        assert "".join(pieces) == want


def test_models_lists_base_and_adapters_without_paths(client: openai.OpenAI, server) -> None:  # noqa: ANN001
    raw = httpx.get(server[0] + "/v1/models").json()["data"]
    by_id = {m["id"]: m for m in raw}
    assert by_id[BASE]["parent"] is None
    for name in DEMO_ADAPTERS:
        assert by_id[name]["parent"] == BASE
        assert re.fullmatch(r"[0-9a-f]{64}", by_id[name]["revision"])
    assert "/" not in str(raw) and str(DEMO_MODEL_DIR.parent) not in str(raw)
    assert {m.id for m in client.models.list()} == set(MODEL_TASK)


def test_pinned_revision_and_n_choices(client: openai.OpenAI, server) -> None:  # noqa: ANN001
    rev = httpx.get(server[0] + "/v1/models").json()["data"][1]
    text = INPUTS[5]
    out = client.completions.create(
        model=f"{rev['id']}@{rev['revision']}", prompt=make_prompt(text), max_tokens=24, temperature=0, n=2
    )
    assert [c.index for c in out.choices] == [0, 1]
    assert all(c.text == answer(rev["id"], text) for c in out.choices)
    sampled = client.completions.create(
        model=BASE, prompt=make_prompt(text), max_tokens=24, temperature=1.0, seed=7, n=3, logprobs=2
    )
    again = client.completions.create(
        model=BASE, prompt=make_prompt(text), max_tokens=24, temperature=1.0, seed=7, n=3, logprobs=2
    )
    assert [c.text for c in sampled.choices] == [c.text for c in again.choices]
    lp = sampled.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) and all(v <= 0 for v in lp.token_logprobs)
    chat = client.chat.completions.create(
        model="upper",
        messages=[{"role": "user", "content": text}],
        max_tokens=24,
        temperature=0,
        logprobs=True,
        top_logprobs=3,
    )
    content = chat.choices[0].logprobs.content
    # the EOS token that ended the answer is a generated token too, with its own logprob
    assert "".join(c.token for c in content) == text.upper() + "</s>"
    assert all(len(c.top_logprobs) == 3 and c.logprob <= 0 for c in content)


def test_many_concurrent_requests_each_get_their_own_task(client: openai.OpenAI, server) -> None:  # noqa: ANN001
    rng = random.Random(5)
    models = list(MODEL_TASK)
    jobs = [(rng.choice(models), rng.choice(INPUTS)) for _ in range(64)]

    def run(job: tuple[str, str]) -> tuple[str, str, str]:
        model, text = job
        out = client.completions.create(model=model, prompt=make_prompt(text), max_tokens=24, temperature=0)
        return model, text, out.choices[0].text

    with concurrent.futures.ThreadPoolExecutor(max_workers=64) as pool:
        results = list(pool.map(run, jobs))
    wrong = [(m, t, got) for m, t, got in results if got != answer(m, t)]
    assert not wrong, wrong[:5]
    metrics = httpx.get(server[0] + "/metrics").text
    most = float(re.search(r"^loraplex_step_distinct_adapters_max (\S+)$", metrics, re.M).group(1))
    assert most >= 3, "no step carried three distinct adapters: requests were not batched together"


def test_stream_arrives_while_request_runs(server) -> None:  # noqa: ANN001
    base_url, srv = server
    engine = srv.async_engine.engine
    body = {
        "model": BASE,
        "prompt": make_prompt("abc"),
        "max_tokens": 58,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    with httpx.stream("POST", base_url + "/v1/completions", json=body, timeout=60) as resp:
        lines = resp.iter_lines()
        first = next(line for line in lines if line.startswith("data: "))
        assert '"text"' in first
        assert len(engine.scheduler.running) >= 1, "first chunk arrived only after the request finished"
        rest = [line for line in lines if line.startswith("data: ")]
    assert rest[-1] == "data: [DONE]"


def test_bad_requests_fail_cleanly_beside_good_ones(client: openai.OpenAI, server) -> None:  # noqa: ANN001
    base_url, srv = server
    good_jobs = [(m, INPUTS[i]) for i, m in enumerate(list(MODEL_TASK) * 2)]
    too_long = "a" * (srv.async_engine.engine.max_model_len + 5)
    bad = [
        ({"model": "nope", "prompt": "abc="}, 404),
        ({"model": "/etc/passwd", "prompt": "abc="}, 404),
        ({"model": "https://example.com/adapter", "prompt": "abc="}, 404),
        ({"model": str(DEMO_ADAPTERS["reverse"]), "prompt": "abc="}, 404),
        ({"model": BASE, "prompt": "abc=", "max_tokens": 0}, 400),
        ({"model": BASE, "prompt": "abc=", "max_tokens": -3}, 400),
        ({"model": BASE, "prompt": too_long}, 400),
        ({"model": BASE, "prompt": "abc=", "temperature": -1}, 400),
        ({"model": BASE}, 400),
    ]
    with concurrent.futures.ThreadPoolExecutor(max_workers=16) as pool:
        goods = [
            pool.submit(
                lambda m, t: (
                    client.completions.create(model=m, prompt=make_prompt(t), max_tokens=24, temperature=0)
                    .choices[0]
                    .text
                ),
                m,
                t,
            )
            for m, t in good_jobs
        ]
        for body, status in bad:
            r = httpx.post(base_url + "/v1/completions", json=body, timeout=30)
            assert r.status_code == status, (body, r.text)
            err = r.json()["error"]
            assert err["message"] and err["type"]
        r = httpx.post(
            base_url + "/v1/completions",
            content=b'{"model": ',
            timeout=30,
            headers={"content-type": "application/json"},
        )
        assert r.status_code == 400 and "JSON" in r.json()["error"]["message"]
        r = httpx.post(base_url + "/v1/chat/completions", json={"model": BASE, "messages": []}, timeout=30)
        assert r.status_code == 400
        for fut, (m, t) in zip(goods, good_jobs, strict=True):
            assert fut.result() == answer(m, t)
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="../../secret", prompt="abc=")


def test_disconnected_stream_is_cancelled_and_freed(server) -> None:  # noqa: ANN001
    base_url, srv = server
    engine = srv.async_engine.engine

    def aborted() -> float:
        text = httpx.get(base_url + "/metrics").text
        return sum(
            float(v)
            for v in re.findall(r'^loraplex_requests_finished_total\{.*reason="abort".*\} (\S+)$', text, re.M)
        )

    before = aborted()
    body = {
        "model": "reverse",
        "prompt": make_prompt("hello"),
        "max_tokens": 58,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    with httpx.stream("POST", base_url + "/v1/completions", json=body, timeout=60) as resp:
        for line in resp.iter_lines():
            if line.startswith("data: "):
                break  # the client goes away after its first chunk
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and (engine.scheduler.running or aborted() == before):
        time.sleep(0.05)
    assert aborted() == before + 1
    assert not engine.scheduler.running and engine.pool.num_used == 0
    ref = engine.adapters.latest("reverse")
    assert engine.adapters.holds(ref) == 0
