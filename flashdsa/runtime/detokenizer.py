"""Incremental detokenization with stop strings, for streaming.

``tokenizers``' DecodeStream turns tokens into text one at a time and releases text only once
it decodes to whole characters (a byte-level token can end inside a UTF-8 character), seeded
with the prompt's last tokens so the first output token gets its leading space right. What no
library does is kept here: stop strings are searched in the new text, and while a request runs the
last len(longest stop) - 1 characters are held back from streaming, since they might start a stop
string; a request that ends inside a character releases what it has (as U+FFFD).
"""

from __future__ import annotations

from typing import Optional

from tokenizers.decoders import DecodeStream

PROMPT_CONTEXT_TOKENS = 5  # prompt tokens that seed the stream, for tokenizers that strip spaces
REPLACEMENT_CHAR = "\ufffd"


def stream_context(tokenizer, prompt_token_ids: list[int], skip_special_tokens: bool = True) -> list[int]:
    """The prompt's last tokens that seed the stream, less trailing ones that end inside a
    character: the stream would hold those bytes back and release them as the output's text."""
    ids = list(prompt_token_ids[-PROMPT_CONTEXT_TOKENS:])
    while ids and tokenizer.decode(ids, skip_special_tokens=skip_special_tokens).endswith(REPLACEMENT_CHAR):
        ids.pop()
    return ids


class Detokenizer:
    """Turns one request's output tokens into text, one token at a time. ``tokenizer`` is a
    transformers tokenizer backed by ``tokenizers`` (``backend_tokenizer``)."""

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
        context = stream_context(tokenizer, prompt_token_ids, skip_special_tokens)
        self.stream = DecodeStream(ids=context, skip_special_tokens=skip_special_tokens)
        self.pending: list[int] = []  # tokens the stream holds back (an incomplete character so far)
        self.stop = stop
        self.include_stop = include_stop
        self.holdback = max((len(s) for s in stop), default=1) - 1
        self.text = ""  # output text found so far (cut at the stop string once one is found)
        self.num_sent = 0  # characters of text already handed out by delta()

    def add_token(self, token_id: int, final: bool = False, find_stop: bool = True) -> Optional[str]:
        """Append one token; return the stop string it completed, if any (text is then cut).

        final: the request ends with this token, so an incomplete character is released as is.
        find_stop False: stop strings are not looked for in this token's text (before min_tokens).
        """
        piece = self.stream.step(self.tokenizer.backend_tokenizer, token_id)
        self.pending.append(token_id)
        if piece is None and final:
            piece = self.tokenizer.decode(self.pending, skip_special_tokens=self.skip_special_tokens)
        if not piece:
            return None
        self.pending.clear()
        old_len = len(self.text)
        self.text += piece
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
