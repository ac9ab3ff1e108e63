"""Engine options (``EngineConfig``) and the cache size they lead to (``plan_num_blocks``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from flashdsa.runtime.checks import check
from flashdsa.runtime.model_runner import state_slots
from flashdsa.runtime.sequence import BLOCK_SIZE


@dataclass
class EngineConfig:
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_model_len: Optional[int] = None  # default: the model's max_position_embeddings
    num_blocks: Optional[int] = None  # default: cache_fraction of the device memory (CUDA)
    cache_fraction: float = 0.9
    enable_prefix_caching: bool = True
    enforce_eager: bool = False  # True: no CUDA graphs for decode steps
    speculative_tokens: int = 0  # 1: draft one token per step with the MTP layer (speculative decoding)
    async_scheduling: Optional[bool] = None  # overlap the host's work with the GPU (runtime/overlap.py); None: on CUDA

    def __post_init__(self) -> None:
        check(self.max_num_seqs >= 1, f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        check(self.max_num_batched_tokens >= 1, f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}")
        check(self.max_model_len is None or self.max_model_len >= 2, f"max_model_len must be >= 2, got {self.max_model_len}")
        check(self.num_blocks is None or self.num_blocks >= 1, f"num_blocks must be >= 1, got {self.num_blocks}")
        check(0 < self.cache_fraction <= 1, f"cache_fraction must be in (0, 1], got {self.cache_fraction}")
        check(self.speculative_tokens in (0, 1), f"speculative_tokens must be 0 or 1, got {self.speculative_tokens}")

    def model_len(self, positions: int) -> int:
        """Tokens a sequence may hold on a model of ``positions`` positions: max_model_len, by
        default all of them. ValueError if max_model_len asks for more."""
        check(self.max_model_len is None or self.max_model_len <= positions,
              f"max_model_len {self.max_model_len} exceeds the model's {positions} positions "
              f"(max_position_embeddings): pass at most {positions}")
        return self.max_model_len or positions


def plan_num_blocks(model: torch.nn.Module, config: EngineConfig, device: torch.device, max_model_len: int) -> int:
    """Blocks for the caches: as configured, else a fraction of free device memory, never more
    than the running sequences could fill."""
    ceiling = config.max_num_seqs * -(-max_model_len // BLOCK_SIZE)
    if config.num_blocks is not None:
        return config.num_blocks
    if device.type != "cuda":
        return min(ceiling, 1024)
    free, total = torch.cuda.mem_get_info(device)
    budget = free - (1 - config.cache_fraction) * total
    running, snapshots = state_slots(model, config.max_num_seqs, config.enable_prefix_caching)
    if running:
        budget -= (running + 1 + snapshots) * model.state_bytes_per_slot()  # + 1: see state_slots
    return max(1, min(ceiling, int(budget // model.cache_bytes_per_block())))
