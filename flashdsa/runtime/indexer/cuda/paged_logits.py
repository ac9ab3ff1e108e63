"""Paged indexer logits for decode through the native kernel of ``paged_logits.cu``: cache blocks
copied into a shared-memory ring with cp.async, scored with FP8 wgmma, the head sum in registers.
Importing this module builds the indexer's native extension once (``flashdsa.runtime.native``); a
failed build raises ImportError, so dispatch falls back to Triton and says why."""

from __future__ import annotations

import torch

from flashdsa.runtime import native

native.load("indexer")
_paged_logits_cuda = torch.ops.flashdsa.indexer_logits_paged_cuda.default  # the overload, resolved once

BLOCK_SIZE = 64  # cache block tokens the kernel takes: one wgmma's M
BLOCKS_PER_CTA = 16  # cache blocks a CTA scores, fewer while the grid would leave SMs idle
WAVES = 4  # CTAs an SM the grid should at least give (several share an SM)


def _blocks_per_cta(batch: int, width_blocks: int, device: torch.device) -> int:
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    per_cta = BLOCKS_PER_CTA
    while per_cta > 1 and batch * -(-width_blocks // per_cta) < WAVES * sms:
        per_cta //= 2
    return per_cta


def indexer_logits_paged(q_fp8: torch.Tensor, weights: torch.Tensor, k_cache: torch.Tensor,
                         context_lens: torch.Tensor, block_tables: torch.Tensor, max_context_len: int,
                         fill_past_context: bool = True, *, blocks_per_cta: int | None = None) -> torch.Tensor:
    """Arguments and result of ``flashdsa.runtime.indexer.indexer_logits_paged`` (64-token cache
    blocks); ``blocks_per_cta`` sets the launch (benchmarks sweep it). CUDA-graph capturable."""
    batch, next_n, _, _ = q_fp8.shape
    out = torch.empty(batch * next_n, max_context_len, dtype=torch.float32, device=q_fp8.device)
    if out.numel() == 0:
        return out
    per_cta = blocks_per_cta or _blocks_per_cta(batch, -(-max_context_len // BLOCK_SIZE), q_fp8.device)
    table = block_tables if block_tables.stride(-1) == 1 else block_tables.contiguous()
    stream = torch._C._cuda_getCurrentRawStream(q_fp8.get_device())
    q = q_fp8.contiguous()
    q = q if q.data_ptr() % 16 == 0 else q.clone()  # a view at an odd offset: the kernel copies 16 bytes at a time
    _paged_logits_cuda(q, weights.contiguous(), k_cache, context_lens.contiguous(), table, max_context_len,
                       fill_past_context, per_cta, out, stream)
    return out
