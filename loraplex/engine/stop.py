"""When a request stops: EOS (unless ignore_eos), stop token ids, stop strings, max_tokens, context."""

from __future__ import annotations

from typing import Any

from loraplex.engine.detokenizer import IncrementalDetokenizer
from loraplex.engine.sequence import Sequence


class StopChecker:
    def __init__(self, tokenizer: Any | None, eos_ids: frozenset[int]) -> None:
        self.tokenizer = tokenizer
        self.eos_ids = eos_ids

    def check(self, seq: Sequence, max_model_len: int) -> str | None:
        """Update seq.text for the newest token and return a finish reason, or None to go on."""
        if self.tokenizer is None:
            # No tokenizer, so seq.text stays "": nothing to detokenize or flush, and no stop string
            # can match. The other checks of _reason, in its order.
            params = seq.params
            output = seq.output_token_ids
            token = output[-1]
            if (not params.ignore_eos and token in self.eos_ids) or token in params.stop_token_ids:
                return "stop"
            if len(output) >= params.max_tokens or len(seq.prompt_token_ids) + len(output) >= max_model_len:
                return "length"
            return None
        reason = self._reason(seq, max_model_len)
        if reason is not None and seq.detokenizer is not None and reason != "stop_string":
            seq.text += seq.detokenizer.flush(seq.output_token_ids)
        return "stop" if reason == "stop_string" else reason

    def _reason(self, seq: Sequence, max_model_len: int) -> str | None:
        params = seq.params
        token = seq.output_token_ids[-1]
        searched_to = len(seq.text)
        if self.tokenizer is not None:
            if seq.detokenizer is None:
                seq.detokenizer = IncrementalDetokenizer(self.tokenizer)
            seq.text += seq.detokenizer.add(seq.output_token_ids)
        if not params.ignore_eos and token in self.eos_ids:
            return "stop"
        if token in params.stop_token_ids:
            return "stop"
        if params.stop and self._truncate_at_stop_string(seq, searched_to):
            return "stop_string"
        if len(seq.output_token_ids) >= params.max_tokens or seq.num_tokens >= max_model_len:
            return "length"
        return None

    @staticmethod
    def _truncate_at_stop_string(seq: Sequence, searched_to: int) -> bool:
        # Only text that arrived this step can complete a new match: start the search far enough
        # back for a stop string that straddles the old and the new text.
        longest = max(len(s) for s in seq.params.stop)
        start = max(0, searched_to - longest + 1)
        hits = [(seq.text.find(s, start), s) for s in seq.params.stop]
        hits = [(i, s) for i, s in hits if i >= 0]
        if not hits:
            return False
        index, stop = min(hits)
        end = index + len(stop) if seq.params.include_stop_str_in_output else index
        seq.text = seq.text[:end]
        return True
