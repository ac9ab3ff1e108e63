"""Per-request sampling parameters, validated on construction (ValueError naming the field)."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Optional

from flashdsa.runtime.checks import check
from flashdsa.runtime.structured import StructuredOutputsParams

MAX_LOGPROBS = 20  # the OpenAI API's limit on top_logprobs


@dataclass
class SamplingParams:
    """How to pick each next token and when to stop.

    temperature 0 is greedy. top_k 0 (or -1) and top_p 1 and min_p 0 disable those filters.
    repetition_penalty divides positive (multiplies negative) logits of tokens seen in the prompt
    or output; presence/frequency penalties subtract from logits of tokens in the output.
    max_tokens None means "up to the model's length limit". logprobs N returns the sampled token's
    log-probability plus the N most likely (raw model distribution); prompt_logprobs likewise for
    the prompt tokens. Stop strings are cut from the text unless include_stop_str_in_output.
    structured_outputs constrains the output to a grammar (JSON schema, regex, choice, ...);
    skip_special_tokens drops special tokens from the text (keep them to parse tool calls).
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: Optional[int] = None
    max_tokens: Optional[int] = 16
    min_tokens: int = 0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    logprobs: Optional[int] = None
    prompt_logprobs: Optional[int] = None
    structured_outputs: Optional[StructuredOutputsParams] = None
    skip_special_tokens: bool = True

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = [s for s in self.stop if s]
        check(self.n >= 1, f"n must be >= 1, got {self.n}")
        check(self.temperature >= 0, f"temperature must be >= 0, got {self.temperature}")
        check(0 < self.top_p <= 1, f"top_p must be in (0, 1], got {self.top_p}")
        check(self.top_k >= -1, f"top_k must be -1, 0 (off) or positive, got {self.top_k}")
        check(0 <= self.min_p <= 1, f"min_p must be in [0, 1], got {self.min_p}")
        check(self.repetition_penalty > 0, f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        check(-2 <= self.presence_penalty <= 2, f"presence_penalty must be in [-2, 2], got {self.presence_penalty}")
        check(-2 <= self.frequency_penalty <= 2, f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}")
        check(self.max_tokens is None or self.max_tokens >= 1, f"max_tokens must be >= 1, got {self.max_tokens}")
        check(self.min_tokens >= 0, f"min_tokens must be >= 0, got {self.min_tokens}")
        check(
            self.max_tokens is None or self.min_tokens <= self.max_tokens,
            f"min_tokens ({self.min_tokens}) must be <= max_tokens ({self.max_tokens})",
        )
        check(self.seed is None or 0 <= self.seed < 2**63, f"seed must be in [0, 2**63), got {self.seed}")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            check(value is None or 0 <= value <= MAX_LOGPROBS, f"{name} must be in [0, {MAX_LOGPROBS}], got {value}")
        check(all(t >= 0 for t in self.stop_token_ids), f"stop_token_ids must be >= 0, got {self.stop_token_ids}")
        check(  # both decide where the output may end; together they can leave no token to sample
            self.structured_outputs is None or self.min_tokens == 0,
            "min_tokens cannot be combined with structured outputs (the grammar decides where the output ends)",
        )

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5

    def for_choice(self, index: int) -> "SamplingParams":
        """Parameters of choice ``index`` of n: one sample each, seed offset so choices differ."""
        return replace(self, n=1, seed=None if self.seed is None else self.seed + index)
