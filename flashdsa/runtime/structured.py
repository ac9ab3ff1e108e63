"""Structured outputs: grammars the sampled tokens must follow (xgrammar).

A request names its grammar with ``StructuredOutputsParams`` (vLLM's names: json, regex, choice,
grammar, json_object, or an xgrammar structural tag). Each becomes one xgrammar structural tag,
compiled once: xgrammar's compiler caches compiled grammars keyed by the tag's JSON, so a schema
sent again (or by the n choices of a request) is not compiled again. Each sequence follows its
grammar with its own matcher. Each step, the matchers of the batch fill one token bitmask
``[N, ceil(vocab / 32)] int32`` on the host (threaded), which goes to the device in one copy and
is applied to the logits by xgrammar's kernel inside the sampler; rows without a grammar allow
every token. The sampled tokens, read back once per step anyway, advance the matchers.
"""

from __future__ import annotations

import json
import os
import re
import threading
from dataclasses import dataclass
from typing import Any, Optional, Union

import torch
import xgrammar as xgr

from flashdsa.models.chat_template import THINK_END

_LOG_PREFIX = re.compile(r"^\[[\d:]+\] \S+:\d+: ")  # xgrammar's "[time] file.cc:line: " before its messages
# Longest whitespace run JSON may hold: deep enough for pretty-printing, and a model that
# prefers whitespace (as small ones do) cannot pad forever without ever closing the document.
MAX_JSON_WHITESPACE = 16
_KINDS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")


@dataclass(frozen=True)
class StructuredOutputsParams:
    """Exactly one grammar for the output.

    json: a JSON schema (dict or JSON text); regex: a regular expression; choice: the output is one
    of these strings; grammar: EBNF (GBNF) with a ``root`` rule; json_object: any JSON object or
    array; structural_tag: an xgrammar structural tag (dict or JSON text). JSON holds whitespace
    runs of at most MAX_JSON_WHITESPACE characters.
    after_reasoning: the output first closes a reasoning block (any text, then ``</think>``) and
    follows the grammar after it (thinking mode, where the prompt opened ``<think>``).
    source names the request field in error messages.
    """

    json: Optional[Union[str, dict]] = None
    regex: Optional[str] = None
    choice: Optional[list[str]] = None
    grammar: Optional[str] = None
    json_object: bool = False
    structural_tag: Optional[Union[str, dict]] = None
    after_reasoning: bool = False
    source: str = "structured_outputs"

    def __post_init__(self) -> None:
        given = [kind for kind in _KINDS if getattr(self, kind) not in (None, False)]
        if len(given) != 1:
            raise ValueError(f"{self.source}: give exactly one of {', '.join(_KINDS)} (got {given or 'none'})")
        if self.choice is not None and (not self.choice or not all(isinstance(c, str) for c in self.choice)):
            raise ValueError(f"{self.source}: choice must be a non-empty list of strings")

    def tag_json(self) -> str:
        """The xgrammar structural tag of this grammar, as JSON (the compile cache's key)."""
        if self.structural_tag is not None:
            tag = _load(self.structural_tag, self.source)
            if not isinstance(tag, dict) or not isinstance(tag.get("format"), dict):
                raise ValueError(f"{self.source}: a structural tag is an object with a 'format' object")
            form = tag["format"]
        elif self.json is not None:
            form = _json_format(_load(self.json, self.source))
        elif self.regex is not None:
            form = {"type": "regex", "pattern": self.regex}
        elif self.choice is not None:
            form = {"type": "or", "elements": [{"type": "const_string", "value": c} for c in self.choice]}
        elif self.grammar is not None:
            form = {"type": "grammar", "grammar": self.grammar}
        else:  # json_object: as vLLM's, a JSON object or array
            form = _json_format({"type": ["object", "array"]})
        if self.after_reasoning:
            thoughts = {"type": "any_text", "excludes": [THINK_END]}
            reasoning = {"type": "tag", "begin": "", "content": thoughts, "end": THINK_END}
            form = {"type": "sequence", "elements": [reasoning, form]}
        return json.dumps({"type": "structural_tag", "format": form}, ensure_ascii=False)


def _json_format(schema: Any) -> dict:
    return {"type": "json_schema", "json_schema": schema, "max_whitespace_cnt": MAX_JSON_WHITESPACE}


def _load(value: Union[str, dict], source: str) -> Any:
    if not isinstance(value, str):
        return value
    try:
        return json.loads(value)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{source}: not valid JSON: {exc}") from None


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    """Set the logits of tokens the grammars forbid to -inf, in place.

    logits: [N, vocab] fp32; bitmask: [N, ceil(vocab / 32)] int32 on the same device (bit set: allowed).
    """
    xgr.apply_token_bitmask_inplace(logits, bitmask)


class Grammars:
    """Compiles structured-output grammars for one tokenizer and builds each step's token bitmask.

    The tokenizer scan (about a second for a 129K vocabulary) happens on the first request that
    asks for a grammar. compile() may run on any thread (the server compiles before it admits a
    request); the bitmask and the matchers belong to the engine thread.
    """

    def __init__(self, tokenizer, vocab_size: int, cache_mib: int = 512) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.max_threads = min(8, os.cpu_count() or 1)
        self.cache_bytes = cache_mib << 20  # compiled grammars kept (least recently used dropped first)
        self._compiler: Optional[xgr.GrammarCompiler] = None
        self._lock = threading.Lock()
        self._batch: Optional[xgr.BatchGrammarMatcher] = None
        self._bitmask: Optional[torch.Tensor] = None  # host rows reused every step (pinned for CUDA)
        self._copied: Optional[torch.cuda.Event] = None  # the last copy out of those rows

    def _get_compiler(self) -> xgr.GrammarCompiler:
        with self._lock:
            if self._compiler is None:
                info = xgr.TokenizerInfo.from_huggingface(self.tokenizer, vocab_size=self.vocab_size)
                self._compiler = xgr.GrammarCompiler(info, max_threads=self.max_threads,
                                                     cache_limit_bytes=self.cache_bytes)
            return self._compiler

    def compile(self, params: StructuredOutputsParams) -> xgr.CompiledGrammar:
        """The compiled grammar (cached by its structural tag); ValueError naming params.source."""
        tag = params.tag_json()
        try:
            return self._get_compiler().compile_structural_tag(tag)
        except Exception as exc:  # xgrammar raises RuntimeError / its own errors for bad grammars
            lines = str(exc).strip().splitlines() or [type(exc).__name__]
            message = _LOG_PREFIX.sub("", lines[0])
            raise ValueError(f"{params.source}: cannot compile the grammar: {message}") from None

    def matcher(self, params: StructuredOutputsParams) -> xgr.GrammarMatcher:
        """A fresh matcher (one per sequence) at the start of the grammar."""
        return xgr.GrammarMatcher(self.compile(params))

    def bitmask(self, matchers: list[Optional[xgr.GrammarMatcher]], device: torch.device) -> Optional[torch.Tensor]:
        """[N, ceil(vocab / 32)] int32 on device for matchers[i] (None: every token allowed), or
        None when no row has a grammar. One host-to-device copy; valid until the next call (on
        the CPU it is the reused host buffer itself)."""
        rows = [i for i, m in enumerate(matchers) if m is not None]
        if not rows:
            return None
        n = len(matchers)
        if self._bitmask is None or self._bitmask.shape[0] < n:
            self._bitmask = xgr.allocate_token_bitmask(max(n, 64), self.vocab_size)
            if device.type == "cuda":
                self._bitmask = self._bitmask.pin_memory()
        if self._batch is None:
            self._batch = xgr.BatchGrammarMatcher("auto")  # half the hardware threads
        if self._copied is not None:
            self._copied.synchronize()  # done long ago in practice: the sampled tokens were read back since
        host = self._bitmask[:n]
        host.fill_(-1)
        self._batch.batch_fill_next_token_bitmask([matchers[i] for i in rows], host, indices=rows)
        on_device = host.to(device, non_blocking=True)
        if device.type == "cuda":
            self._copied = torch.cuda.Event()
            self._copied.record(torch.cuda.current_stream(device))
        return on_device


def advance(matcher: xgr.GrammarMatcher, token: int) -> bool:
    """Feed one sampled token to a sequence's matcher; True once the grammar has ended.

    A token the grammar forbids cannot be sampled (its logit is -inf); if one arrives anyway the
    request fails with RuntimeError, alone.
    """
    if not matcher.accept_token(token):
        raise RuntimeError(f"token {token} does not follow the request's grammar")
    return matcher.is_terminated()
