"""`echo` with prompt logprobs over HTTP, as evaluation harnesses score multiple-choice tasks
(`echo: true, logprobs: N, max_tokens: 0`), through the official client and checked against
transformers + PEFT prompt logprobs in float32 on the demo adapters."""

from __future__ import annotations

import openai
import pytest
import torch
import transformers
from helpers.live_server import live_server
from helpers.reference import BASE as PEFT_BASE
from helpers.reference import load_peft_mixture

from loraplex.demo import DEMO_ADAPTERS, DEMO_MODEL_DIR
from loraplex.demo.tasks import held_out_inputs, make_prompt

SERVED = "loraplex-demo"
TOP_N = 5
ATOL = 1e-4


@pytest.fixture(scope="module")
def client():  # noqa: ANN201
    adapters = {name: str(path) for name, path in DEMO_ADAPTERS.items()}
    with live_server(str(DEMO_MODEL_DIR), adapters) as (base_url, _):
        yield openai.OpenAI(base_url=base_url + "/v1", api_key="x", max_retries=0)


@pytest.fixture(scope="module")
def reference():  # noqa: ANN201
    base = transformers.AutoModelForCausalLM.from_pretrained(str(DEMO_MODEL_DIR), dtype=torch.float32)
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(DEMO_MODEL_DIR))
    peft = load_peft_mixture(base.eval(), dict(DEMO_ADAPTERS))

    @torch.no_grad()
    def prompt_logprobs(model: str, text: str) -> tuple[list[int], torch.Tensor, list[str]]:
        ids = tokenizer.encode(text)
        name = PEFT_BASE if model == SERVED else model
        logits = peft(input_ids=torch.tensor([ids]), adapter_names=[name]).logits.float()
        vocab = [tokenizer.decode([t]) for t in range(logits.shape[-1])]
        return ids, torch.log_softmax(logits[0], dim=-1), vocab

    return prompt_logprobs


@pytest.mark.parametrize("model", [SERVED, *DEMO_ADAPTERS])
def test_scoring_a_prompt_matches_peft(client: openai.OpenAI, reference, model: str) -> None:  # noqa: ANN001
    for text in held_out_inputs(12, seed=3)[:3]:
        prompt = make_prompt(text) + text[::-1]  # a question and a candidate answer
        out = client.completions.create(model=model, prompt=prompt, echo=True, logprobs=TOP_N, max_tokens=0)
        choice = out.choices[0]
        assert choice.text == prompt and choice.finish_reason == "length"
        assert out.usage.completion_tokens == 0 and out.usage.prompt_tokens == len(prompt)
        ids, ref, vocab = reference(model, prompt)
        lp = choice.logprobs
        assert lp.tokens == [vocab[t] for t in ids]
        assert lp.text_offset == list(range(len(prompt)))
        assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
        for pos in range(1, len(ids)):
            want = ref[pos - 1]  # row p - 1 predicts token p
            assert abs(lp.token_logprobs[pos] - float(want[ids[pos]])) <= ATOL, (model, prompt, pos)
            top = lp.top_logprobs[pos]
            ref_top = {vocab[t]: float(want[t]) for t in torch.topk(want, TOP_N).indices.tolist()}
            assert set(ref_top) <= set(top), (pos, ref_top, top)
            assert all(abs(top[k] - v) <= ATOL for k, v in ref_top.items())


def test_echo_with_generation_joins_prompt_and_completion(client: openai.OpenAI, reference) -> None:  # noqa: ANN001
    prompt = make_prompt("hello")
    out = client.completions.create(
        model="reverse", prompt=prompt, echo=True, logprobs=2, max_tokens=10, temperature=0
    )
    choice = out.choices[0]
    assert choice.text == prompt + "olleh"
    lp = choice.logprobs
    assert "".join(lp.tokens) == prompt + "olleh</s>"
    assert lp.text_offset[: len(prompt) + 1] == list(range(len(prompt) + 1))
    assert lp.token_logprobs[0] is None and all(v <= 0 for v in lp.token_logprobs[1:])
    assert out.usage.completion_tokens == len("olleh") + 1
    # echo without logprobs: text only; streamed: the prompt first, then the tokens
    plain = client.completions.create(model="upper", prompt=prompt, echo=True, max_tokens=10, temperature=0)
    assert plain.choices[0].text == prompt + "HELLO" and plain.choices[0].logprobs is None
    stream = client.completions.create(
        model="upper", prompt=prompt, echo=True, max_tokens=10, temperature=0, stream=True
    )
    pieces = [chunk.choices[0].text for chunk in stream]
    assert pieces[0] == prompt and "".join(pieces) == prompt + "HELLO"
    # token-id prompts echo their decoded text
    ids, _, _ = reference(SERVED, prompt)
    by_ids = client.completions.create(model=SERVED, prompt=ids, echo=True, max_tokens=0, logprobs=0)
    assert by_ids.choices[0].text == prompt and by_ids.choices[0].logprobs.token_logprobs[0] is None
