"""When a request stops: EOS (unless ignore_eos), stop token ids, stop strings, max_tokens, context."""

from __future__ import annotations

from typing import Any

from loraplex.engine.sequence import Sequence


class StopChecker:
    def __init__(self, tokenizer: Any | None, eos_ids: frozenset[int]) -> None:
        self.tokenizer = tokenizer
        self.eos_ids = eos_ids

    def check(self, seq: Sequence, max_model_len: int) -> str | None:
        """Update seq.text for the newest token and return a finish reason, or None to go on."""
        params = seq.params
        token = seq.output_token_ids[-1]
        if self.tokenizer is not None:
            seq.text = self.tokenizer.decode(seq.output_token_ids, skip_special_tokens=True)
        if not params.ignore_eos and token in self.eos_ids:
            return "stop"
        if token in params.stop_token_ids:
            return "stop"
        if params.stop and self._truncate_at_stop_string(seq):
            return "stop"
        if len(seq.output_token_ids) >= params.max_tokens or seq.num_tokens >= max_model_len:
            return "length"
        return None

    @staticmethod
    def _truncate_at_stop_string(seq: Sequence) -> bool:
        hits = [(seq.text.find(s), s) for s in seq.params.stop]
        hits = [(i, s) for i, s in hits if i >= 0]
        if not hits:
            return False
        index, stop = min(hits)
        end = index + len(stop) if seq.params.include_stop_str_in_output else index
        seq.text = seq.text[:end]
        return True
