"""Incremental detokenization: each new token costs a decode of a short window, not of the whole
output (which made long generations quadratic in their length).

A token's text can depend on its neighbours (leading-space markers, byte-level pieces that only
form a character together), so the window starts a few tokens back: text is emitted for the
tokens after `read` once decoding `[prefix:]` gives more than decoding `[prefix:read]` and does
not end in an incomplete character.
"""

from __future__ import annotations

from typing import Any

_CONTEXT_TOKENS = 5  # tokens decoded before the new ones, so merges across the boundary come out right


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.text = ""
        self._prefix = 0  # window start
        self._read = 0  # tokens whose text is already in self.text

    def add(self, token_ids: list[int]) -> str:
        """Feed the whole output so far (only the new tail is decoded); returns the new text."""
        decode = self.tokenizer.decode
        prefix_text = decode(token_ids[self._prefix : self._read], skip_special_tokens=True)
        full_text = decode(token_ids[self._prefix :], skip_special_tokens=True)
        if len(full_text) <= len(prefix_text) or full_text.endswith("\ufffd"):
            return ""  # nothing printable yet (a special token, or half of a character)
        new = full_text[len(prefix_text) :]
        self.text += new
        self._read = len(token_ids)
        self._prefix = max(0, self._read - _CONTEXT_TOKENS)
        return new

    def flush(self, token_ids: list[int]) -> str:
        """At the end of a request: emit whatever is left, even an incomplete character."""
        if self._read >= len(token_ids):
            return ""
        decode = self.tokenizer.decode
        prefix_text = decode(token_ids[self._prefix : self._read], skip_special_tokens=True)
        new = decode(token_ids[self._prefix :], skip_special_tokens=True)[len(prefix_text) :]
        self.text += new
        self._read = len(token_ids)
        return new
