"""Turns a scheduled step into model inputs (token ids + BatchMetadata) and runs the model.

Decode steps replay CUDA graphs (``cuda_graphs.DecodeGraphs``) on CUDA in production mode unless
``enforce_eager``; prefill and mixed steps, and reference mode, run eagerly. Under tensor
parallelism the runner of rank 0 sends each step's inputs to the other ranks' runners
(``runtime.parallel.steps``), which execute the same step (the same graph) on their shard. With
speculative decoding (one GPU) the runner keeps each step's final hidden states, and
:meth:`ModelRunner.draft` runs the MTP layer over the same tokens to draft the next ones."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from flashdsa.runtime.checks import trusted_values
from flashdsa.runtime.cuda_graphs import DecodeGraphs
from flashdsa.runtime.metadata import BatchMetadata, advance
from flashdsa.runtime.parallel import steps
from flashdsa.runtime.scheduler import DEVICE_TOKEN, ScheduledChunk
from flashdsa.runtime.transfer import TokenFill, to_device


@dataclass
class StepLogits:
    """logits: [N, vocab] fp32; chunk i's rows are logits[row_start[i] : row_start[i] + num_rows[i]].

    A chunk that samples has its sampling row last; a chunk that wants prompt logprobs has one
    row per token it ran (row j predicts the token after position chunk.start + j); a chunk with
    a draft has two rows: its last token's, then the draft's. verdict: a speculative step that its
    decode graph verified (``ModelRunner.run(..., verify=True)``): the packed verdict
    (``DecodeGraphs.replay_verdict``); its logits are then None (they never left the graph).
    """

    logits: Optional[torch.Tensor]
    row_start: list[int]
    num_rows: list[int]
    verdict: Optional[torch.Tensor] = None

    def sampling_row(self, i: int, chunk: ScheduledChunk) -> int:
        """The row of chunk i's last token, which its next token is sampled from (a draft's row follows it)."""
        return self.row_start[i] + self.num_rows[i] - 1 - (chunk.draft is not None)


def build_metadata(chunks: list[ScheduledChunk]) -> tuple[torch.Tensor, BatchMetadata, list[int], list[int]]:
    """Flat input ids [T] int64 and the step's BatchMetadata (CPU), plus each chunk's logits rows.

    Built with a handful of batched tensor ops, so the cost per step stays small at batch 128+.
    A token still on the device (async scheduling: the last one of a chunk, and a draft the step
    in flight made) gets id ``DEVICE_TOKEN`` here; the runner's ``TokenFill`` writes it on the device.
    """
    ids: list[int] = []
    logits_indices: list[int] = []
    row_start, num_rows = [], []
    for chunk in chunks:
        first = len(ids)
        known = chunk.seq.token_ids[chunk.start : chunk.start + chunk.num_tokens]
        ids += known + [DEVICE_TOKEN] * (chunk.num_tokens - len(known))
        row_start.append(len(logits_indices))
        if chunk.draft is not None:
            ids.append(chunk.draft)
            logits_indices += [len(ids) - 2, len(ids) - 1]
        elif chunk.seq.wants_prompt_logprobs:
            logits_indices += range(first, len(ids))
        elif chunk.samples:
            logits_indices.append(len(ids) - 1)
        num_rows.append(len(logits_indices) - row_start[-1])
    width = max(len(c.seq.block_table) for c in chunks)
    tables = torch.tensor([c.seq.block_table + [-1] * (width - len(c.seq.block_table)) for c in chunks], dtype=torch.int32)
    slots = [c.seq.state_slot for c in chunks]
    meta = BatchMetadata.for_step([c.start for c in chunks], [c.num_run for c in chunks], tables,
                                  torch.tensor(logits_indices, dtype=torch.int64),
                                  state_slots=slots if min(slots) >= 0 else None)
    return torch.tensor(ids, dtype=torch.int64), meta, row_start, num_rows


class ModelRunner:
    """Owns the model and its paged caches (MLA latent + indexer keys, one block table; the MTP
    layer's pools come last and share the block table, so they live and die with the blocks), and
    the per-sequence state of models that keep one (``num_state_slots``)."""

    def __init__(self, model: torch.nn.Module, num_blocks: int, device: torch.device, max_num_seqs: int = 1,
                 max_model_len: int = 0, enforce_eager: bool = True, speculative: bool = False,
                 prefix_caching: bool = False) -> None:
        self.model = model
        getattr(model, "prepare_for_inference", lambda: None)()  # e.g. fused projections, before any capture
        self.device = device
        self.speculative = speculative
        # the last step's metadata (None: it ran as a graph), hidden states and input ids on the device
        self.last: tuple[BatchMetadata | None, torch.Tensor, torch.Tensor] | None = None
        shard = getattr(model, "shard", None)
        if speculative and shard is not None and shard.size > 1:
            raise ValueError("speculative decoding runs on one GPU: use tensor_parallel_size 1")
        self.leader = shard if shard is not None and shard.size > 1 and shard.rank == 0 else None
        if self.leader is not None:
            steps.send(self.leader, steps.RunnerSpec(num_blocks, max_num_seqs, max_model_len, enforce_eager))
        running, snapshots = state_slots(model, max_num_seqs, prefix_caching)
        self.caches = model.allocate_caches(num_blocks, running + 1 + snapshots) if running else \
            model.allocate_caches(num_blocks)
        self.graphs = None
        if (not enforce_eager and device.type == "cuda" and getattr(model, "mode", None) == "production"
                and getattr(model, "supports_cuda_graphs", True)):
            self.graphs = DecodeGraphs(model, self.caches, max_num_seqs, max_model_len, device, speculative)
            self.graphs.capture()

    def run(self, chunks: list[ScheduledChunk], fill: Optional[TokenFill] = None, verify: bool = False) -> StepLogits:
        """Run the scheduled chunks; ``fill`` writes the input ids only the device has (one rank
        only) and, behind a speculative step, says which sequences the device moves one position on.
        ``verify``: the step is a speculative decode step of greedy requests only, which a decode
        graph, where one runs it, verifies and drafts in the same replay (``StepLogits.verdict``)."""
        input_ids, meta, row_start, num_rows = build_metadata(chunks)
        if fill is not None and fill.moves is not None:
            meta = meta.with_room([m >= 0 for m in fill.moves])
        decode = _is_decode(chunks, self.speculative)
        self._copy_states([(c.restore_from, c.seq.state_slot) for c in chunks if c.restore_from >= 0])
        if verify and self._graphed(decode, meta):  # nothing is left for :meth:`draft`
            self.last = None
            logits, verdict = None, self.graphs.replay_verdict(input_ids, meta, fill)
        else:
            logits, verdict = self.forward(input_ids, meta, decode, fill), None
        self._copy_states([(c.seq.state_slot, c.snapshot_to) for c in chunks if c.snapshot_to >= 0])
        return StepLogits(logits, row_start, num_rows, verdict)

    def _graphed(self, decode: bool, meta: BatchMetadata) -> bool:
        """Whether a step (``decode``: a decode step) replays a decode graph."""
        return self.graphs is not None and decode and self.graphs.can_run(meta.num_seqs, meta.max_context_len)

    def _copy_states(self, pairs: list[tuple[int, int]]) -> None:
        """Copy state slots ``(source, destination)`` (prefix-cache snapshots), in stream order."""
        if pairs:
            self.caches.copy_slots(*(torch.tensor(side, device=self.device) for side in zip(*pairs)))

    def forward(self, input_ids: torch.Tensor, meta: BatchMetadata, decode: bool = False,
                fill: Optional[TokenFill] = None) -> torch.Tensor:
        """Run one step given as CPU tensors on every rank (rank 0 sends it to the others): logits.
        The others replay a graph exactly where rank 0 does (their collectives must pair up with its
        own), so rank 0 sends its own choice as ``decode``."""
        if self.leader is not None:
            decode = self._graphed(decode, meta)
            steps.send_step(self.leader, input_ids, meta, decode, fill)
        return self.execute(input_ids, meta, decode, fill)

    @torch.inference_mode()
    def execute(self, input_ids: torch.Tensor, meta: BatchMetadata, decode: bool,
                fill: Optional[TokenFill] = None) -> torch.Tensor:
        """Logits [N, vocab] fp32 of one step (``decode``: a graph replays it when one fits); ``fill``
        takes the ids and moves only the device knows (inside the graph when one runs). The inputs
        go up without a host sync, so this only queues work on CUDA."""
        self.last = None
        graph = self._graphed(decode, meta)
        if graph:
            logits = self.graphs.replay(input_ids, meta, fill)
            input_ids = self.graphs.input_ids(input_ids.numel())
        else:
            meta, input_ids = meta.to(self.device), to_device(input_ids, self.device)
            if fill is not None:
                input_ids, moved = fill.apply(input_ids)
                if moved is not None:
                    meta = advance(meta, moved)
            kwargs = {"return_hidden": True} if self.speculative else {}
            with trusted_values():  # the block manager built the slots and tables: no device syncs to check them
                logits = self.model(input_ids, meta, self.caches, **kwargs)
        if self.speculative:
            logits, hidden = logits
            self.last = (None if graph else meta, hidden, input_ids)
        return logits.float()

    def verdict_buffer(self, numel: int) -> Optional[torch.Tensor]:
        """Where a speculative step's packed verdict (``speculative.DeviceVerdict``, ``numel`` int64)
        goes: the decode graphs' ``source``, which the next step's graph reads in place, or None (a
        new tensor) without graphs."""
        if self.graphs is None or numel > self.graphs.source.numel():
            return None
        return self.graphs.source[:numel]

    def last_input_ids(self) -> torch.Tensor:
        """The last step's input ids on the device (speculative runners keep them)."""
        return self.last[2]

    @torch.inference_mode()
    def draft(self, next_ids: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """The MTP layer's draft logits ``[len(rows), vocab]`` after the last step: ``next_ids[j]``
        (int64, host or device) is the token that follows flat token j of that step (any id where
        unknown), ``rows`` the flat tokens whose drafts are wanted."""
        meta, hidden, _ = self.last
        if meta is None:  # the step ran as a CUDA graph: so does its MTP layer
            return self.graphs.replay_draft(next_ids, rows)
        meta = BatchMetadata(**{**vars(meta), "logits_indices": rows.to(self.device)})
        with trusted_values():
            return self.model.mtp_forward(next_ids.to(self.device), hidden, meta, self.caches)


def state_slots(model: torch.nn.Module, max_num_seqs: int, prefix_caching: bool) -> tuple[int, int]:
    """(slots for running sequences, snapshot slots) of a model with per-sequence state
    (DeepSeek-V4's window and compressor states): one per running sequence and, with prefix caching,
    as many snapshots (``BlockManager``); (0, 0) for a model whose paged caches hold everything (V3.2).
    The runner allocates one more slot, the CUDA graphs' padding rows'."""
    if not hasattr(model, "state_bytes_per_slot"):
        return 0, 0
    return max_num_seqs, max_num_seqs if prefix_caching else 0


def _is_decode(chunks: list[ScheduledChunk], speculative: bool = False) -> bool:
    """Every sequence runs one token and samples it (one logits row each, in order), and with
    speculation every one has a draft (two rows each)."""
    return all(c.num_tokens == 1 and c.samples and not c.seq.wants_prompt_logprobs
               and (c.draft is not None) == speculative for c in chunks)
