"""Incremental detokenization with stop strings, for streaming.

A byte-level tokenizer can end a token in the middle of a UTF-8 character; decoding then gives
U+FFFD. Text is only released once the tokens decode to complete characters: we decode a small
window of recent tokens and take what it adds over the text of its stable part. Stop strings are
searched in the new text; while a request runs, the last len(longest stop) - 1 characters are
held back from streaming, because they might be the start of a stop string.
"""

from __future__ import annotations

from typing import Optional

REPLACEMENT_CHAR = "\ufffd"
PROMPT_CONTEXT_TOKENS = 5  # prompt tokens decoded with the output, for tokenizers that strip spaces


class Detokenizer:
    """Turns one request's output tokens into text, one token at a time."""

    def __init__(
        self,
        tokenizer,
        prompt_token_ids: list[int],
        stop: list[str],
        include_stop: bool = False,
        skip_special_tokens: bool = True,
    ) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids = list(prompt_token_ids[-PROMPT_CONTEXT_TOKENS:])
        self.prefix_offset = 0  # ids[prefix_offset:read_offset] decode to text already released
        self.read_offset = len(self.ids)
        self.stop = stop
        self.include_stop = include_stop
        self.holdback = max((len(s) for s in stop), default=1) - 1
        self.text = ""  # output text found so far (cut at the stop string once one is found)
        self.num_sent = 0  # characters of text already handed out by delta()

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def add_token(self, token_id: int, final: bool = False, find_stop: bool = True) -> Optional[str]:
        """Append one token; return the stop string it completed, if any (text is then cut).

        final: the request ends with this token, so an incomplete character is released as is.
        find_stop False: stop strings are not looked for in this token's text (before min_tokens).
        """
        self.ids.append(token_id)
        stable = self._decode(self.ids[self.prefix_offset : self.read_offset])
        full = self._decode(self.ids[self.prefix_offset :])
        if len(full) <= len(stable) or (full.endswith(REPLACEMENT_CHAR) and not final):
            return None
        old_len = len(self.text)
        self.text += full[len(stable) :]
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        return self._find_stop(old_len) if find_stop else None

    def _find_stop(self, old_len: int) -> Optional[str]:
        best: Optional[tuple[int, str]] = None
        for s in self.stop:
            at = self.text.find(s, max(0, old_len - len(s) + 1))
            if at >= 0 and (best is None or at < best[0]):
                best = (at, s)
        if best is None:
            return None
        at, s = best
        self.text = self.text[: at + len(s) if self.include_stop else at]
        return s

    def delta(self, finished: bool) -> str:
        """Text not handed out yet; while running, minus what could start a stop string."""
        end = len(self.text) if finished else max(self.num_sent, len(self.text) - self.holdback)
        out = self.text[self.num_sent : end]
        self.num_sent = end
        return out
