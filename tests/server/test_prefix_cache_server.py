"""The prefix cache through the HTTP API: `cache_salt` on completions and chat, the hit counters in
/metrics, and the flag that turns the cache off."""

from __future__ import annotations

import re

import httpx
import pytest
from helpers.live_server import live_server

from loraplex.cli import build_parser
from loraplex.config_cli import engine_config_from_args
from loraplex.demo import DEMO_ADAPTERS, DEMO_MODEL_DIR

BASE = "loraplex-demo"
PROMPT = "the quick brown fox jumps over the lazy dog and"  # 47 characters: 2 full blocks of 16 hit


@pytest.fixture(scope="module")
def base_url():  # noqa: ANN201
    adapters = {name: str(path) for name, path in DEMO_ADAPTERS.items()}
    with live_server(str(DEMO_MODEL_DIR), adapters) as (url, _srv):
        yield url


def _counter(url: str, name: str, unit: str) -> float:
    text = httpx.get(url + "/metrics").text
    m = re.search(rf'^loraplex_prefix_cache_{name}\{{unit="{unit}"\}} (\S+)$', text, re.M)
    return float(m.group(1)) if m else 0.0


def _hit_tokens_of(url: str, body: dict) -> float:
    """The prefix-cache tokens one request took (read from /metrics around it), checking its answer."""
    before = _counter(url, "hits_total", "tokens")
    r = httpx.post(url + "/v1/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    return _counter(url, "hits_total", "tokens") - before


def test_cache_salt_separates_requests_and_metrics_count_hits(base_url: str) -> None:
    body = {"model": "reverse", "prompt": PROMPT, "max_tokens": 4, "temperature": 0}
    assert _hit_tokens_of(base_url, {**body, "cache_salt": "s1"}) == 0
    assert _hit_tokens_of(base_url, {**body, "cache_salt": "s2"}) == 0  # another salt: no hit
    assert _hit_tokens_of(base_url, body) == 0  # no salt: its own cache
    assert _hit_tokens_of(base_url, {**body, "cache_salt": "s1"}) == 32
    assert _hit_tokens_of(base_url, {**body, "model": "upper"}) == 0  # another adapter: no hit
    assert _hit_tokens_of(base_url, {**body, "model": BASE}) == 0  # the base: no hit
    assert _hit_tokens_of(base_url, body) == 32
    queries = _counter(base_url, "queries_total", "tokens")
    assert queries >= 7 * len(PROMPT)
    text = httpx.get(base_url + "/metrics").text
    rate = float(re.search(r'^loraplex_prefix_cache_hit_rate\{unit="tokens"\} (\S+)$', text, re.M).group(1))
    assert 0 < rate < 1
    assert re.search(r'^loraplex_prefix_cache_hits_total\{unit="blocks"\} [1-9]', text, re.M)


def test_chat_takes_a_cache_salt_and_bad_salts_are_refused(base_url: str) -> None:
    chat = {
        "model": BASE,
        "messages": [{"role": "user", "content": "abc"}],
        "max_tokens": 2,
        "cache_salt": "x",
    }
    r = httpx.post(base_url + "/v1/chat/completions", json=chat, timeout=60)
    assert r.status_code == 200, r.text
    for bad in ("", 7, ["x"]):
        body = {"model": BASE, "prompt": "abc", "max_tokens": 1, "cache_salt": bad}
        r = httpx.post(base_url + "/v1/completions", json=body, timeout=60)
        assert r.status_code == 400 and "cache_salt" in r.text


def test_the_flag_turns_the_cache_off() -> None:
    parser = build_parser()
    on = engine_config_from_args("/m", parser.parse_args(["serve"]))
    off = engine_config_from_args("/m", parser.parse_args(["serve", "--no-enable-prefix-caching"]))
    assert on.cache.enable_prefix_caching and not off.cache.enable_prefix_caching
