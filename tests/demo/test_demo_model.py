"""The shipped demo model and adapters do their tasks on held-out inputs, in loraplex's engine (one
mixed batch) and in transformers + PEFT directly; the chat template gives the completion prompt."""

from __future__ import annotations

import json

import pytest
import torch

from loraplex import LLM, SamplingParams
from loraplex.demo import DEMO_ADAPTERS, DEMO_MODEL_DIR, tasks

N_ENGINE = 600  # held-out inputs per model in the engine batch (5 x 600 rows)
N_PEFT = 96  # a smaller sample for the transformers + PEFT cross-check
MODELS: dict[str | None, str] = {None: "copy", **{name: name for name in DEMO_ADAPTERS}}
GREEDY = SamplingParams(max_tokens=20, temperature=0.0)


@pytest.fixture(scope="module")
def llm() -> LLM:
    llm = LLM(DEMO_MODEL_DIR, max_num_seqs=512, max_num_batched_tokens=8192)
    for name, path in DEMO_ADAPTERS.items():
        llm.register_adapter(name, path)
    return llm


@pytest.fixture(scope="module")
def engine_outputs(llm: LLM) -> dict[str | None, list[str]]:
    """Every model on the same held-out inputs, all in one generate call (rows of 5 adapters mixed)."""
    inputs = tasks.held_out_inputs(N_ENGINE)
    prompts = [tasks.make_prompt(x) for x in inputs] * len(MODELS)
    adapters = [a for a in MODELS for _ in inputs]
    outs = llm.generate(prompts, GREEDY, adapters=adapters)
    assert all(o.token_ids[-1] == 2 for o in outs), "every answer ends with EOS (</s>, id 2)"
    texts = [o.text for o in outs]
    return {a: texts[i * len(inputs) : (i + 1) * len(inputs)] for i, a in enumerate(MODELS)}


def test_tasks_and_held_out_split() -> None:
    assert tasks.TASKS["caesar"]("xyz abc") == "abc def"
    assert tasks.TASKS["sort"]("b a") == " ab"
    assert tasks.make_prompt("ab") == "ab=" and tasks.make_prompt("ab", "sort") == "S:ab="
    inputs = tasks.held_out_inputs(N_ENGINE)
    assert len(set(inputs)) == N_ENGINE and all(map(tasks.is_held_out, inputs))
    assert {len(x) for x in inputs} == set(range(1, 17))
    assert all(set(x) <= set(tasks.ALPHABET) for x in inputs)


def test_shipped_files() -> None:
    assert set(DEMO_ADAPTERS) == {"reverse", "upper", "sort", "caesar"}
    assert (DEMO_MODEL_DIR / "model.safetensors").is_file()
    assert json.loads((DEMO_MODEL_DIR / "config.json").read_text())["architectures"] == ["LlamaForCausalLM"]
    ranks = set()
    for path in DEMO_ADAPTERS.values():
        assert (path / "adapter_model.safetensors").is_file()
        ranks.add(json.loads((path / "adapter_config.json").read_text())["r"])
    assert len(ranks) > 1, "the adapters differ in rank, so serving them mixes ranks"
    total = sum(f.stat().st_size for f in DEMO_MODEL_DIR.parent.rglob("*") if f.is_file())
    assert total < 8 * 2**20


@pytest.mark.parametrize("adapter", list(MODELS), ids=lambda a: a or "base")
def test_engine_accuracy_and_confusion(
    engine_outputs: dict[str | None, list[str]], adapter: str | None
) -> None:
    inputs = tasks.held_out_inputs(N_ENGINE)
    s = tasks.score(MODELS[adapter], inputs, engine_outputs[adapter])
    assert s.accuracy >= 0.99, f"{adapter or 'base'}: {s.accuracy:.3f}; failures {s.failures}"
    assert s.worst_confusion <= 0.10, f"{adapter or 'base'} gives other tasks' answers: {s.confusion}"


def test_peft_agrees_with_engine(engine_outputs: dict[str | None, list[str]]) -> None:
    """The shipped artefacts behave the same in plain transformers + PEFT (outside loraplex)."""
    from peft import PeftModel
    from transformers import AutoTokenizer, LlamaForCausalLM

    tok = AutoTokenizer.from_pretrained(str(DEMO_MODEL_DIR))
    base = LlamaForCausalLM.from_pretrained(str(DEMO_MODEL_DIR), dtype=torch.float32).eval()
    names = list(DEMO_ADAPTERS)
    peft = PeftModel.from_pretrained(base, str(DEMO_ADAPTERS[names[0]]), adapter_name=names[0])
    for name in names[1:]:
        peft.load_adapter(str(DEMO_ADAPTERS[name]), adapter_name=name)
    inputs = tasks.held_out_inputs(N_ENGINE)[:N_PEFT]
    theirs = _peft_mixed_greedy(peft.eval(), tok, inputs)
    for adapter, task in MODELS.items():
        assert theirs[adapter] == engine_outputs[adapter][:N_PEFT], f"{adapter or 'base'}: PEFT != loraplex"
        assert tasks.score(task, inputs, theirs[adapter]).accuracy >= 0.99


@torch.no_grad()
def _peft_mixed_greedy(peft, tok, inputs: list[str]) -> dict[str | None, list[str]]:  # noqa: ANN001
    """PEFT's own mixed batch (`adapter_names`), one batch per input length so no row is padded."""
    out: dict[str | None, list[str]] = {a: [""] * len(inputs) for a in MODELS}
    for length in sorted({len(x) for x in inputs}):
        idx = [i for i, x in enumerate(inputs) if len(x) == length]
        rows = [(a, i) for a in MODELS for i in idx]
        ids = torch.tensor([tok.encode(tasks.make_prompt(inputs[i])) for _, i in rows])
        gen = peft.generate(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            adapter_names=["__base__" if a is None else a for a, _ in rows],
            max_new_tokens=20,
            do_sample=False,
            eos_token_id=2,
            pad_token_id=0,
        )
        for (a, i), row in zip(rows, gen[:, ids.shape[1] :].tolist(), strict=True):
            out[a][i] = tok.decode(row[: row.index(2)] if 2 in row else row, skip_special_tokens=True)
    return out


def test_chat_template_renders_the_completion_prompt(llm: LLM) -> None:
    from transformers import AutoTokenizer

    assert "chat_template" in json.loads((DEMO_MODEL_DIR / "tokenizer_config.json").read_text())
    tok = AutoTokenizer.from_pretrained(str(DEMO_MODEL_DIR))
    messages = [
        {"role": "system", "content": "ignored"},
        {"role": "user", "content": "first"},
        {"role": "assistant", "content": "FIRST"},
        {"role": "user", "content": "hello world"},
    ]
    text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert text == "hello world="
    parts = [{"role": "user", "content": [{"type": "text", "text": "hello"}, {"type": "text", "text": " x"}]}]
    assert tok.apply_chat_template(parts, add_generation_prompt=True, tokenize=False) == "hello x="
    ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    assert list(ids) == tok.encode("hello world=")
    chat, completion = llm.generate([list(ids), "hello world="], GREEDY, adapters="upper")
    assert chat.text == completion.text == "HELLO WORLD"
