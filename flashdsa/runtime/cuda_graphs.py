"""Decode steps replayed as CUDA graphs, one per batch-size bucket.

A decode step (every sequence runs one token and samples it) has the same kernels whatever the
batch holds, so the model runner captures the forward once per bucket of batch sizes and replays
it: one host-to-device copy of the step's inputs and one graph launch instead of thousands of
kernel launches. A step of B sequences replays the smallest bucket >= B; the rows past B are
padding that writes no cache slot (slot -1) and reads block 0 (their outputs are dropped).

Inputs live in one static int64 buffer, ``[ids | positions | context_lens | slots | block table]``,
each field ``max_batch`` long and the table ``max_batch x max_blocks``, so the copy of a step is
one prefix of it. The graph itself unpacks the buffer into the model's ``BatchMetadata``. The
paged indexer scores ``max_model_len`` columns (fixed at capture); each row's top-k scans only its
own context.
"""

from __future__ import annotations

import logging
import time

import torch

from flashdsa.runtime.checks import trusted_values
from flashdsa.runtime.metadata import BatchMetadata

logger = logging.getLogger(__name__)

FIELDS = 4  # ids, positions, context_lens, slots


def batch_buckets(max_batch: int) -> list[int]:
    """1, 2, 4, 8, then every multiple of 16 up to ``max_batch`` (and ``max_batch`` itself)."""
    sizes = [b for b in (1, 2, 4, 8) if b < max_batch] + list(range(16, max_batch, 16)) + [max_batch]
    return sorted(set(sizes))


class DecodeGraphs:
    """Captured decode forwards of ``model`` over ``caches`` for batches up to ``max_batch``."""

    def __init__(self, model: torch.nn.Module, caches, max_batch: int, max_model_len: int, device: torch.device):
        self.model, self.caches, self.device = model, caches, device
        self.max_batch, self.max_model_len = max_batch, max_model_len
        self.block_size = caches.block_size
        self.max_blocks = -(-max_model_len // self.block_size)
        self.table_offset = FIELDS * max_batch
        size = self.table_offset + max_batch * self.max_blocks
        self.staging = torch.zeros(size, dtype=torch.int64).pin_memory()
        self.inputs = torch.zeros(size, dtype=torch.int64, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.buckets = batch_buckets(max_batch)

    def can_run(self, batch: int, max_context_len: int) -> bool:
        return batch <= self.max_batch and max_context_len <= self.max_model_len

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every bucket, largest first, sharing one memory pool; logs time and memory."""
        start, before = time.perf_counter(), torch.cuda.memory_reserved(self.device)
        self._fill_padding(0, self.max_batch)
        self.inputs.copy_(self.staging)
        pool = torch.cuda.graph_pool_handle()
        for batch in reversed(self.buckets):
            self._forward(batch)  # warm-up: compiles kernels outside the capture
            torch.cuda.synchronize(self.device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.outputs[batch] = self._forward(batch)
            self.graphs[batch] = graph
        torch.cuda.synchronize(self.device)
        logger.info("captured %d decode CUDA graphs (batch %s) in %.1f s, %.2f GiB of graph memory",
                    len(self.graphs), self.buckets, time.perf_counter() - start,
                    (torch.cuda.memory_reserved(self.device) - before) / 2**30)

    def replay(self, input_ids: torch.Tensor, meta: BatchMetadata) -> torch.Tensor:
        """Logits ``[B, vocab]`` fp32 of a decode step whose host-side inputs are ``input_ids: [B]``
        and ``meta`` (CPU tensors). Valid until the next replay."""
        batch = input_ids.shape[0]
        bucket = next(b for b in self.buckets if b >= batch)
        mb, s = self.max_batch, self.staging
        for i, field in enumerate((input_ids, meta.positions, meta.context_lens, meta.slot_mapping)):
            s[i * mb : i * mb + batch] = field
        table = s[self.table_offset : self.table_offset + bucket * self.max_blocks].view(bucket, self.max_blocks)
        table[:batch].fill_(-1)
        table[:batch, : meta.block_tables.shape[1]] = meta.block_tables
        self._fill_padding(batch, bucket)
        used = self.table_offset + bucket * self.max_blocks
        self.inputs[:used].copy_(s[:used], non_blocking=True)
        self.graphs[bucket].replay()
        return self.outputs[bucket][:batch]

    def _fill_padding(self, first: int, last: int) -> None:
        """Rows [first, last): token 0 at position 0 of a one-token context in block 0, writing nothing."""
        mb, s = self.max_batch, self.staging
        for i, value in enumerate((0, 0, 1, -1)):
            s[i * mb + first : i * mb + last] = value
        s[self.table_offset + first * self.max_blocks : self.table_offset + last * self.max_blocks] = 0

    def _forward(self, batch: int) -> torch.Tensor:
        """The model's decode forward over the first ``batch`` rows of the static inputs."""
        mb, x = self.max_batch, self.inputs
        rows = torch.arange(batch, device=self.device)
        table = x[self.table_offset : self.table_offset + batch * self.max_blocks].view(batch, self.max_blocks)
        meta = BatchMetadata(
            positions=x[mb : mb + batch], seq_ids=rows, query_start_loc=torch.arange(batch + 1, device=self.device,
                                                                                     dtype=torch.int32),
            context_lens=x[2 * mb : 2 * mb + batch].to(torch.int32), slot_mapping=x[3 * mb : 3 * mb + batch],
            block_tables=table.to(torch.int32), logits_indices=rows,
            query_lens=(1,) * batch, context_lens_host=(self.max_model_len,) * batch,
            max_context_len=self.max_model_len,
        )
        with trusted_values():
            return self.model(x[:batch], meta, self.caches)
