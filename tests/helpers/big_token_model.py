"""A copy of the demo model whose tokenizer has one extra, very long added token.

A server may refuse a prompt string longer than context length x the longest vocabulary entry
without tokenizing it (no prompt of that many characters can fit). The demo tokenizer's longest
entry is 5 characters ("<pad>"), so the demo model refuses a 2 MiB prompt for free; with one
40,000-character entry the bound is 64 x 40,000 = 2.56M characters and a prompt just under the
2 MiB body limit is really tokenized (about a second with this tokenizer), as on a real model.

The token is never produced: the model's embedding has the demo's 99 rows, the added token's id
is 99, and no prompt sent to this copy contains its character.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from loraplex.demo import DEMO_MODEL_DIR

LONG_TOKEN_CHAR = "\x7f"  # DEL: outside the demo alphabet and every prompt the tests send
LONG_TOKEN_CHARS = 40_000
LONG_TOKEN = LONG_TOKEN_CHAR * LONG_TOKEN_CHARS


def build_big_token_model(dest: Path) -> Path:
    """Copy the demo model into `dest` (which must not exist) and add the long token to its
    tokenizer.json. tokenizer_config.json is copied unchanged, so `tokenizer_class` stays
    PreTrainedTokenizerFast (loadable by transformers 4.x and 5.x) and the chat template is the
    demo's. Checks that transformers reloads the result as intended."""
    from tokenizers import AddedToken, Tokenizer
    from transformers import AutoTokenizer

    shutil.copytree(DEMO_MODEL_DIR, dest)
    core = Tokenizer.from_file(str(dest / "tokenizer.json"))
    base_size = core.get_vocab_size(with_added_tokens=True)
    # normalized=False: matched verbatim, like the demo's special tokens
    core.add_tokens([AddedToken(LONG_TOKEN, normalized=False, single_word=False)])
    core.save(str(dest / "tokenizer.json"))

    demo = AutoTokenizer.from_pretrained(str(DEMO_MODEL_DIR))
    tok = AutoTokenizer.from_pretrained(str(dest))
    assert len(tok) == base_size + 1, (len(tok), base_size)
    assert max(len(entry) for entry in tok.get_vocab()) == LONG_TOKEN_CHARS
    assert tok.encode(LONG_TOKEN) == [base_size]
    assert tok.encode("hello world=") == demo.encode("hello world=")
    assert tok.chat_template == demo.chat_template
    return dest
