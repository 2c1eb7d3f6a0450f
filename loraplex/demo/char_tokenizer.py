"""A character-level tokenizer (printable ASCII + 4 specials), saved in Hugging Face format."""

from __future__ import annotations

from pathlib import Path

SPECIALS = ("<pad>", "<s>", "</s>", "<unk>")
CHARS = tuple(chr(c) for c in range(32, 127))


def build_char_tokenizer():  # noqa: ANN201 (transformers.PreTrainedTokenizerFast)
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(SPECIALS + CHARS)}
    # BPE without merges splits text into single characters; Fuse joins them back verbatim.
    core = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    core.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(
        tokenizer_object=core,
        pad_token="<pad>",
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
    )


def save_char_tokenizer(path: Path) -> None:
    build_char_tokenizer().save_pretrained(str(path))


VOCAB_SIZE = len(SPECIALS) + len(CHARS)
