"""Incremental detokenisation with stop strings held back until they can no longer match."""

from __future__ import annotations

import re
from collections.abc import Sequence

from asyncengine.client.tokenizer import Tokenizer
from asyncengine.sampling_params import SamplingParams

# Prompt tokens fed to the decode stream first, so the first new token gets its spacing right.
_PROMPT_CONTEXT_TOKENS = 6


class IncrementalDetokenizer:
    """Text of one generated sequence, grown token by token.

    `update()` returns the stop string that matched, if any; the text is then cut at it
    (or just after it with include_stop_str_in_output). `visible_text` holds back the tail
    that could still become the start of a stop string.
    """

    def __init__(
        self, tokenizer: Tokenizer, prompt_token_ids: Sequence[int], params: SamplingParams
    ) -> None:
        self.tokenizer = tokenizer
        self.stream = tokenizer.decode_stream(
            prompt_token_ids[-_PROMPT_CONTEXT_TOKENS:], params.skip_special_tokens
        )
        self.stop = params.stop or []
        self.include_stop = params.include_stop_str_in_output
        max_stop_len = max((len(s) for s in self.stop), default=0)
        self.hold_back = 0 if self.include_stop or not self.stop else max_stop_len - 1
        self.max_stop_len = max_stop_len
        self._stop_pattern = re.compile("|".join(map(re.escape, self.stop)))
        self.text = ""

    def update(self, new_token_ids: Sequence[int]) -> str | None:
        """Append the tokens' text; return the stop string found in it, if any."""
        for token_id in new_token_ids:
            old_len = len(self.text)
            piece = self.tokenizer.step(self.stream, token_id)
            if piece:
                self.text += piece
            if self.stop and len(self.text) > old_len:
                hit = self._find_stop(old_len)
                if hit is not None:
                    return hit
        return None

    def _find_stop(self, old_len: int) -> str | None:
        # Only a match that ends inside the new text is new: search a window reaching back
        # one stop-string length before it.
        window_start = max(0, old_len - self.max_stop_len + 1)
        # One pass for every stop string: the earliest match, the first listed on a tie.
        match = self._stop_pattern.search(self.text, window_start)
        if match is None:
            return None
        idx, stop = match.start(), match.group()
        self.text = self.text[: idx + len(stop)] if self.include_stop else self.text[:idx]
        return stop

    def visible_text(self, finished: bool) -> str:
        """The text safe to show: all of it once finished, else minus the held-back tail."""
        if finished or self.hold_back == 0:
            return self.text
        return self.text[: max(0, len(self.text) - self.hold_back)]
