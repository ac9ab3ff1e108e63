"""Per-request sampling parameters, validated on construction (ValueError naming the field)."""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Optional, Union

from flashdsa.runtime.checks import check
from flashdsa.runtime.structured import StructuredOutputsParams

logger = logging.getLogger(__name__)

MAX_LOGPROBS = 20  # the OpenAI API's limit on top_logprobs
MAX_LOGIT_BIAS = 100.0  # the OpenAI API's limit on each logit_bias value
INT64_MAX = 2**63 - 1
FLOAT_FIELDS = ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty")
INT_FIELDS = ("n", "top_k", "seed", "max_tokens", "min_tokens", "logprobs", "prompt_logprobs")
# generation_config.json keys that set sampling defaults (as vLLM reads them), by SamplingParams name
GENERATION_CONFIG_KEYS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
                          "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_tokens"}


def _is_finite(value: object) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value)


def _is_int64(value: object) -> bool:
    return isinstance(value, int) and -INT64_MAX - 1 <= value <= INT64_MAX


@dataclass
class SamplingParams:
    """How to pick each next token and when to stop.

    temperature 0 is greedy. top_k 0 (or -1) and top_p 1 and min_p 0 disable those filters; a
    top_k above the vocabulary keeps every token. repetition_penalty divides positive (multiplies
    negative) logits of tokens seen in the prompt or output; presence/frequency penalties subtract
    from logits of tokens in the output. logit_bias {token id: bias in [-100, 100]} is added to the
    logits before everything else. max_tokens None means "up to the model's length limit"; 0 (with
    prompt_logprobs) runs the prompt only, to score it. Until min_tokens are out, EOS and the stop
    token ids cannot be sampled and no stop string ends the request. logprobs N returns the sampled
    token's log-probability plus the N most likely (raw model distribution); prompt_logprobs likewise
    for the prompt tokens. Stop strings are cut from the text unless include_stop_str_in_output;
    special tokens are left out of the text when skip_special_tokens (keep them to parse tool calls).
    structured_outputs constrains the output to a grammar (JSON schema, regex, choice, ...).
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[int, float] = field(default_factory=dict)
    seed: Optional[int] = None
    max_tokens: Optional[int] = 16
    min_tokens: int = 0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    logprobs: Optional[int] = None
    prompt_logprobs: Optional[int] = None
    structured_outputs: Optional[StructuredOutputsParams] = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = [s for s in self.stop if s]
        self._check_types()
        check(self.n >= 1, f"n must be >= 1, got {self.n}")
        check(self.temperature >= 0, f"temperature must be >= 0, got {self.temperature}")
        check(0 < self.top_p <= 1, f"top_p must be in (0, 1], got {self.top_p}")
        check(self.top_k >= -1, f"top_k must be -1, 0 (off) or positive, got {self.top_k}")
        check(0 <= self.min_p <= 1, f"min_p must be in [0, 1], got {self.min_p}")
        check(self.repetition_penalty > 0, f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        check(-2 <= self.presence_penalty <= 2, f"presence_penalty must be in [-2, 2], got {self.presence_penalty}")
        check(-2 <= self.frequency_penalty <= 2, f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}")
        for token, bias in self.logit_bias.items():
            check(token >= 0, f"logit_bias keys must be token ids >= 0, got {token}")
            check(abs(bias) <= MAX_LOGIT_BIAS, f"logit_bias values must be in [-100, 100], got {bias} for token {token}")
        check(self.max_tokens is None or self.max_tokens >= 1 or (self.max_tokens == 0 and self.prompt_logprobs is not None),
              f"max_tokens must be >= 1 (or 0 with prompt_logprobs, to score the prompt), got {self.max_tokens}")
        check(self.min_tokens >= 0, f"min_tokens must be >= 0, got {self.min_tokens}")
        check(
            self.max_tokens is None or self.min_tokens <= self.max_tokens,
            f"min_tokens ({self.min_tokens}) must be <= max_tokens ({self.max_tokens})",
        )
        check(self.seed is None or self.seed >= 0, f"seed must be in [0, 2**63), got {self.seed}")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            check(value is None or 0 <= value <= MAX_LOGPROBS, f"{name} must be in [0, {MAX_LOGPROBS}], got {value}")
        check(all(t >= 0 for t in self.stop_token_ids), f"stop_token_ids must be >= 0, got {self.stop_token_ids}")
        check(  # both decide where the output may end; together they can leave no token to sample
            self.structured_outputs is None or self.min_tokens == 0,
            "min_tokens cannot be combined with structured outputs (the grammar decides where the output ends)",
        )

    def _check_types(self) -> None:
        """Every float finite and every integer an int64, so that no value overflows a tensor."""
        for name in FLOAT_FIELDS:
            value = getattr(self, name)
            check(_is_finite(value), f"{name} must be a finite number, got {value}")
        for name in INT_FIELDS:
            value = getattr(self, name)
            check(value is None or _is_int64(value), f"{name} must be an integer in [-2**63, 2**63), got {value}")
        check(all(_is_int64(t) for t in self.stop_token_ids), "stop_token_ids must be integers below 2**63")
        check(all(_is_int64(t) and _is_finite(b) for t, b in self.logit_bias.items()),
              "logit_bias must map integer token ids to finite numbers")

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5

    def for_choice(self, index: int) -> "SamplingParams":
        """Parameters of choice ``index`` of n: one sample each, seed offset so choices differ."""
        seed = None if self.seed is None else (self.seed + index) % (INT64_MAX + 1)
        return replace(self, n=1, seed=seed)


def generation_defaults(model_dir: Union[str, Path]) -> dict[str, Any]:
    """The sampling defaults a checkpoint sets in its generation_config.json (the keys it gives
    that differ from transformers' defaults), as SamplingParams keyword arguments; {} if none."""
    from transformers import GenerationConfig

    if not (Path(model_dir) / "generation_config.json").is_file():
        return {}
    given = GenerationConfig.from_pretrained(str(model_dir)).to_diff_dict()
    defaults = {ours: given[theirs] for theirs, ours in GENERATION_CONFIG_KEYS.items() if given.get(theirs) is not None}
    SamplingParams(**defaults)  # ValueError, naming the key, if the checkpoint's values are out of range
    logger.info("sampling defaults from %s/generation_config.json: %s", model_dir, defaults)
    return defaults
