"""Incremental detokenization equals decoding the whole output, for byte-level and
metaspace (sentencepiece-style) BPE tokenizers, multi-byte characters included."""

from __future__ import annotations

import random

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from loraplex.demo.char_tokenizer import build_char_tokenizer
from loraplex.engine.detokenizer import IncrementalDetokenizer

CORPUS = [
    "the quick brown fox jumps over the lazy dog",
    "héllo wörld, ça va? naïve café",
    "多语言 服务 适配器 批处理 模型",
    "emoji 🙂🚀 and symbols ∑∫ mixed with text",
    "  leading spaces and\ttabs\nnew lines  ",
] * 20


def _train(kind: str) -> PreTrainedTokenizerFast:
    core = Tokenizer(models.BPE(unk_token=None if kind == "byte" else "<unk>"))
    if kind == "byte":
        core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        core.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(
            vocab_size=400, special_tokens=["</s>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
        )
    else:
        core.pre_tokenizer = pre_tokenizers.Metaspace()
        core.decoder = decoders.Metaspace()
        trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["</s>", "<unk>"])
    core.train_from_iterator(CORPUS, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=core, eos_token="</s>")


@pytest.mark.parametrize("kind", ["byte", "metaspace", "char"])
def test_incremental_text_equals_full_decode(kind: str) -> None:
    tok = build_char_tokenizer() if kind == "char" else _train(kind)
    rng = random.Random(0)
    texts = [*CORPUS[:5], "🙂🙂 déjà vu 模型🚀"]
    for _ in range(20):
        words = rng.choices(" ".join(CORPUS[:5]).split(), k=rng.randint(1, 12))
        texts.append(" ".join(words))
    for text in texts:
        if kind == "char":
            text = text.encode("ascii", "ignore").decode()
        ids = tok.encode(text) + [tok.eos_token_id]
        detok = IncrementalDetokenizer(tok)
        pieces = [detok.add(ids[: i + 1]) for i in range(len(ids))]
        pieces.append(detok.flush(ids))
        want = tok.decode(ids, skip_special_tokens=True)
        assert "".join(pieces) == want == detok.text, (kind, text)
        assert all("\ufffd" not in p for p in pieces if "\ufffd" not in want)
