"""Sampling through the engine: per-request seeds, stop strings / token ids / EOS, max_tokens."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from loraplex import LLM, SamplingParams
from loraplex.demo.tiny_model import build_tiny_model


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "m", seed=4)


@pytest.fixture(scope="module")
def llm(model_dir: Path) -> LLM:
    return LLM(model_dir)


def sampled(seed: int, n: int = 24, **kw) -> SamplingParams:  # noqa: ANN003
    return SamplingParams(
        max_tokens=n, temperature=1.0, top_p=0.95, top_k=40, seed=seed, ignore_eos=True, **kw
    )


def test_same_seed_same_tokens_whatever_the_batch(llm: LLM) -> None:
    alone = llm.generate(["abc"], sampled(123))[0]
    crowd = llm.generate(
        ["zz top", "abc", "hello", "abc"],
        [sampled(1), sampled(123), SamplingParams(temperature=0), sampled(9)],
    )
    assert crowd[1].token_ids == alone.token_ids
    assert crowd[3].token_ids != alone.token_ids  # another seed, another draw
    again = llm.generate(["abc"], sampled(123))[0]
    assert again.token_ids == alone.token_ids


def test_stop_string_truncates_text(llm: LLM) -> None:
    free = llm.generate(["the quick"], sampled(5))[0]
    stop = free.text[6:8]
    first = free.text.find(stop)
    out = llm.generate(["the quick"], sampled(5, stop=(stop,)))[0]
    assert out.finish_reason == "stop"
    assert out.text == free.text[:first]
    kept = llm.generate(["the quick"], sampled(5, stop=(stop,), include_stop_str_in_output=True))[0]
    assert kept.text == free.text[: first + len(stop)]


def test_stop_token_ids_and_max_tokens(llm: LLM) -> None:
    free = llm.generate(["xyz"], sampled(8))[0]
    assert len(free.token_ids) == 24 and free.finish_reason == "length"
    target = free.token_ids[5]
    first = free.token_ids.index(target)
    out = llm.generate(["xyz"], sampled(8, stop_token_ids=(target,)))[0]
    assert out.token_ids == free.token_ids[: first + 1] and out.finish_reason == "stop"


def test_eos_stops_unless_ignored(model_dir: Path, tmp_path: Path) -> None:
    free = LLM(model_dir).generate(["eos?"], sampled(2))[0]
    eos = free.token_ids[4]
    first = free.token_ids.index(eos)
    moved = tmp_path / "eos"
    moved.mkdir()
    for f in model_dir.iterdir():
        (moved / f.name).write_bytes(f.read_bytes())
    cfg = json.loads((moved / "config.json").read_text())
    cfg["eos_token_id"] = eos
    (moved / "config.json").write_text(json.dumps(cfg))
    llm = LLM(moved)
    params = SamplingParams(max_tokens=24, temperature=1.0, top_p=0.95, top_k=40, seed=2)
    stopped = llm.generate(["eos?"], params)[0]
    assert stopped.token_ids == free.token_ids[: first + 1] and stopped.finish_reason == "stop"
    ignored = llm.generate(["eos?"], sampled(2))[0]
    assert ignored.token_ids == free.token_ids


def test_text_and_token_prompts(llm: LLM) -> None:
    tok = llm.tokenizer
    by_text = llm.generate("hello", SamplingParams(max_tokens=5, temperature=0))[0]
    by_ids = llm.generate([tok.encode("hello")], SamplingParams(max_tokens=5, temperature=0))[0]
    assert by_text.prompt_token_ids == by_ids.prompt_token_ids
    assert by_text.token_ids == by_ids.token_ids
    assert by_text.text == tok.decode(by_text.token_ids, skip_special_tokens=True)


def test_invalid_sampling_params() -> None:
    for kw in (
        {"max_tokens": -1},
        {"max_tokens": None},
        {"temperature": -1},
        {"top_p": 0},
        {"top_p": 1.5},
        {"top_k": -2},
        {"logprobs": -1},
        {"stop": ("",)},
    ):
        with pytest.raises(ValueError):
            SamplingParams(**kw)
