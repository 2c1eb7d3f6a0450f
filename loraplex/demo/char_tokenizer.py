"""A character-level tokenizer (printable ASCII + 4 specials), saved in Hugging Face format."""

from __future__ import annotations

import json
from pathlib import Path

from loraplex.demo.tasks import PROMPT_END

SPECIALS = ("<pad>", "<s>", "</s>", "<unk>")
CHARS = tuple(chr(c) for c in range(32, 127))

# The demo model's chat template: the last user message's content (a string, or OpenAI text parts
# joined) is the prompt and PROMPT_END is the generation prompt, so a chat request tokenizes
# exactly like the equivalent completion `"<content>="`. Other roles carry nothing the model reads.
DEMO_CHAT_TEMPLATE = (
    "{%- set ns = namespace(text='') -%}"
    "{%- for m in messages -%}{%- if m['role'] == 'user' -%}"
    "{%- if m['content'] is string -%}{%- set ns.text = m['content'] -%}"
    "{%- else -%}{%- set ns.text = m['content'] | selectattr('type', 'equalto', 'text')"
    " | map(attribute='text') | join('') -%}{%- endif -%}"
    "{%- endif -%}{%- endfor -%}"
    "{{ ns.text }}{%- if add_generation_prompt -%}" + PROMPT_END + "{%- endif -%}"
)


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


def save_demo_tokenizer(path: Path, model_max_length: int) -> None:
    """The char tokenizer with the demo chat template, stored in tokenizer_config.json."""
    tok = build_char_tokenizer()
    tok.chat_template = DEMO_CHAT_TEMPLATE
    tok.model_max_length = model_max_length
    tok.save_pretrained(str(path), save_jinja_files=False)  # not a separate .jinja file
    # transformers 5 records the class as TokenizersBackend, a name 4.x cannot load; the older
    # name loads in both.
    config_path = Path(path) / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


VOCAB_SIZE = len(SPECIALS) + len(CHARS)
