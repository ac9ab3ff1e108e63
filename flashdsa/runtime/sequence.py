"""One request's state in the engine (its tokens, its block table and how far the cache holds
it) and what a step hands back about it."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Optional

import torch

from flashdsa.runtime.cache.layout import BLOCK_SIZE
from flashdsa.runtime.sampling_params import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class TokenLogprobs:
    """Log-probability of one chosen token and the top alternatives, as {token_id: logprob}."""

    token_id: int
    logprob: float
    rank: int
    top: dict[int, float]


@dataclass
class RequestOutput:
    """What one step added to one request. Latencies (s) are set when they apply."""

    request_id: str
    new_token_ids: list[int]
    new_text: str
    finished: bool
    num_prompt_tokens: int
    num_output_tokens: int
    new_logprobs: list[TokenLogprobs] = field(default_factory=list)
    prompt_logprobs: Optional[list[Optional[TokenLogprobs]]] = None  # on the first output only
    finish_reason: Optional[str] = None  # "stop", "length", "abort" or "error"
    stop_reason: Optional[str | int] = None  # the stop string or stop token id that ended it
    num_cached_tokens: int = 0
    error: Optional[str] = None
    ttft: Optional[float] = None
    itl: Optional[float] = None
    e2e: Optional[float] = None


class Sequence:
    """A request being generated.

    token_ids is prompt + output. The first num_computed_tokens of them are in the caches (their
    slots are in block_table); a step runs the next chunk and samples once the chunk reaches the
    end. Preemption frees the blocks and resets num_computed_tokens to 0 (recompute later). With
    async scheduling the tokens a launched step samples count in num_pending_tokens until the
    host reads them (``num_tokens`` includes them; token_ids does not); a launched step that
    verifies a draft of the sequence may bring one token more (``num_pending_drafts``).
    """

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        max_tokens: int,
        eos_token_id: Optional[int] = None,
    ) -> None:
        self.request_id = request_id
        self.token_ids = list(prompt_token_ids)
        self.num_prompt_tokens = len(prompt_token_ids)
        self.params = params
        self.max_tokens = max_tokens
        self.eos_token_id = eos_token_id
        self.stop_token_ids = frozenset(params.stop_token_ids)
        self.status = SequenceStatus.WAITING
        self.block_table: list[int] = []
        self.num_computed_tokens = 0
        self.num_pending_tokens = 0  # sampled by a step still in flight, not yet in token_ids (async scheduling)
        self.num_pending_drafts = 0  # drafts verified by a step in flight: each may add one token more
        self.block_hashes: list[int] = []  # chained hashes of the full blocks of token_ids
        self.num_registered_blocks = 0  # leading blocks already offered to the prefix cache
        self.state_slot = -1  # the per-sequence state (DeepSeek-V4's window and compressors) it holds, -1: none
        self.restore_from = -1  # a prefix hit's state snapshot to copy into state_slot before its next step
        self.snapshot_to = -1  # the snapshot slot reserved for its state at the prompt's last full block
        self.num_cached_prompt_tokens = 0  # prompt tokens found in the prefix cache (first schedule)
        self.num_preemptions = 0
        self.logprobs: list[TokenLogprobs] = []
        self.prompt_logprobs: list[Optional[TokenLogprobs]] = []
        self.finish_reason: Optional[str] = None
        self.stop_reason: Optional[str | int] = None
        self.arrival_time = time.monotonic()
        self.sampler_tensors: dict[str, tuple[torch.Tensor, ...]] = {}  # built by the sampler, kept for the request's life
        self.generator: Optional[torch.Generator] = None
        self.matcher = None  # the xgrammar matcher of a structured-output request (engine-owned)
        self.draft_token: Optional[int] = None  # the MTP layer's guess of the next token (speculative decoding)
        if params.seed is not None:
            self.generator = torch.Generator().manual_seed(params.seed)

    def __len__(self) -> int:
        return len(self.token_ids)

    @property
    def num_tokens(self) -> int:
        """Tokens including those still on the device: what the scheduler plans with."""
        return len(self.token_ids) + self.num_pending_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def is_finished(self) -> bool:
        return self.status == SequenceStatus.FINISHED

    @property
    def wants_prompt_logprobs(self) -> bool:
        return self.params.prompt_logprobs is not None and self.num_output_tokens == 0

    def num_blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // BLOCK_SIZE)

    def append_token(self, token_id: int) -> None:
        self.token_ids.append(token_id)

    def finish(self, reason: str, stop_reason: Optional[str | int] = None) -> None:
        self.status = SequenceStatus.FINISHED
        self.finish_reason = reason
        self.stop_reason = stop_reason
