"""DeepSeek-V4 attention in the engine: a flat batch of several sequences over the paged caches.

The equations are ``DeepseekV4Attention``'s (its projections, compressors and indexer modules are
used as they are); what changes is where the rows come from (``deepseek_v4_caches``):

* window: each token attends to positions ``(p - W, p]``. In a decode step (one token per
  sequence) the token's row goes into its ring first and the ring is the window pool. Otherwise
  rows before a sequence's first token of the step come from its ring (W - 1 of them, gathered
  into the step's window pool before any is overwritten), the step's own rows follow them, and
  after the attention the rows still in the window at the end of the step go into the ring.
* compressors: the step's tokens update each sequence's state slot (reset where a sequence starts
  at position 0); every window they close becomes an entry (norm + RoPE at the window's start)
  written to the paged pool. A decode step (one token per sequence) updates all states in one
  batched call; other steps go sequence by sequence.
* selection: CSA queries take the lightning indexer's top-k of the visible entries
  (``j < (p + 1) // ratio``), HCA queries every visible entry.

Reference mode attends in fp32 with ``sparse_sink_attention`` over the pools' rows (entries stay in
their pool: the slot ids index it); production mode quantizes the window pool to MODEL1 and runs
``sparse_attention_v4_decode`` over both FP8 pools, and selects with the FP8 indexer.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property

import torch

from flashdsa.models.caches import gather_rows, store_index_key, store_rows
from flashdsa.models.deepseek_v4_attention import DeepseekV4Attention, RopeTable, sparse_sink_attention
from flashdsa.models.deepseek_v4_caches import V4LayerCache, entry_slot_table, lookup_entries
from flashdsa.models.deepseek_v4_compressor import Compressor, Indexer, select_topk, visible_entries
from flashdsa.models.deepseek_v4_config import CSA
from flashdsa.models.indexer import KeyRanges, TopK, fp8_select
from flashdsa.runtime.cache import write_v4_cache
from flashdsa.runtime.cache.layout_v4 import gather_v4
from flashdsa.runtime.cache.pool import v4_pool
from flashdsa.runtime.compressor import compress_decode_step, compress_sequence
from flashdsa.runtime.kernels.v4 import sparse_attention_v4_decode
from flashdsa.runtime.metadata import BatchMetadata
from flashdsa.runtime.streams import branch


@dataclass
class StepPlan:
    """What every layer of one engine step needs besides its input (built once per forward).

    starts: [B] first position each sequence runs; slots: [B] their state slots; ring_old: [B * (W - 1)]
    ring rows (``slot * W + position % W``) of the window rows before each sequence's step, -1 before
    position 0 (None in a decode step); window: [T, W] each token's window rows in the step's pool (decode: the ring; else the W - 1 gathered rows per sequence,
    then the step's tokens), -1 before position 0; ring_new: [T] the ring row each token's row goes
    to, -1 for rows out of the window by the step's end."""

    meta: BatchMetadata
    starts: torch.Tensor
    slots: torch.Tensor
    ring_old: torch.Tensor | None
    window: torch.Tensor
    ring_new: torch.Tensor
    decode: bool
    production: bool
    _entries: dict[int, "EntryPlan"] = field(default_factory=dict, repr=False)

    @classmethod
    def build(cls, meta: BatchMetadata, window: int, production: bool) -> "StepPlan":
        """The plan of ``meta``'s step (device ops only). A decode step (one token per sequence, so
        token b is sequence b's, at its last position) takes about half the ops of the general case:
        in a CUDA graph each op is a node the host launches and the GPU steps through."""
        positions, seq_ids = meta.positions, meta.seq_ids
        slots = torch.arange(len(meta.query_lens), device=positions.device) if meta.state_slots is None \
            else meta.state_slots
        before = window - 1
        wanted = positions[:, None] + torch.arange(-before, 1, device=positions.device)  # [T, W] positions
        if max(meta.query_lens) == 1:  # the ring itself is the pool; every row stays in the window
            rows = slots[:, None] * window + wanted % window
            return cls(meta, positions, slots, None, torch.where(wanted >= 0, rows, -1),
                       slots * window + positions % window, True, production)
        qsl, ends = meta.query_start_loc.long(), meta.context_lens.long()
        starts = ends - (qsl[1:] - qsl[:-1])
        # W - 1 gathered ring rows per sequence, then the step's rows
        old = starts[:, None] - before + torch.arange(before, device=positions.device)  # [B, W - 1] positions
        ring_old = torch.where(old >= 0, slots[:, None] * window + old % window, -1).flatten()
        start = starts[seq_ids, None]
        from_ring = seq_ids[:, None] * before + wanted - (start - before)
        from_step = before * len(meta.query_lens) + qsl[seq_ids, None] + wanted - start
        rows = torch.where(wanted < start, from_ring, from_step)
        keep = positions >= ends[seq_ids] - window
        ring_new = torch.where(keep, slots[seq_ids] * window + positions % window, -1)
        return cls(meta, starts, slots, ring_old, torch.where(wanted >= 0, rows, -1), ring_new, False, production)

    def entries(self, ratio: int) -> "EntryPlan":
        """The step's compressed-entry bookkeeping at ``ratio``: the same for every compressor and
        HCA layer at that ratio, so it is made once a step (else a few dozen small index kernels
        a layer, and a V4 model has dozens of compressed layers)."""
        if ratio not in self._entries:
            self._entries[ratio] = EntryPlan(self, ratio)
        return self._entries[ratio]

    def prepare_entries(self, ratio: int) -> None:
        """Make now what the compressors read of the plan at ``ratio``, each part otherwise made on
        first use: the compressor's and the indexer's branches (``runtime.streams``), forked after
        this call, then read finished tensors instead of each making them. (The indexer's key
        ranges are read by its query branch alone, which makes them.)"""
        shared = self.entries(ratio)
        _ = shared.starts, shared.slots, self.fresh  # cached on first read

    @cached_property
    def fresh(self) -> torch.Tensor:
        """``[B]`` bool: the sequences that start at position 0 (their compressor states reset)."""
        return self.starts == 0

    @cached_property
    def window_rows(self) -> torch.Tensor:
        """``window`` as int32, as the production kernels take it (made once a step)."""
        return self.window.int()

    def window_pool(self, ring: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
        """The step's window rows (reference: ``[rows, D]`` float; production: a MODEL1 pool): in a
        decode step the ring, ``kv: [T, D]`` written into it; else each sequence's W - 1 ring rows,
        then ``kv``."""
        if self.decode:
            store_v4_rows(ring, kv, self.ring_new)
            return ring if self.production else ring.view(-1, ring.shape[-1])
        if not self.production:
            return torch.cat([ring.view(-1, ring.shape[-1])[self.ring_old.clamp_min(0)].to(kv.dtype), kv])
        old = self.ring_old.numel()
        pool = v4_pool(1, kv.device, old + kv.shape[0])
        rows = torch.arange(old + kv.shape[0], device=kv.device)
        write_v4_cache(gather_v4(ring, self.ring_old.clamp_min(0)), pool, torch.where(self.ring_old >= 0, rows[:old], -1))
        write_v4_cache(kv, pool, rows[old:])
        return pool

    def store_window(self, ring: torch.Tensor, kv: torch.Tensor) -> None:
        """After the attention: the rows still in the window go into the ring (a decode step's already did)."""
        if not self.decode:
            store_v4_rows(ring, kv, self.ring_new)


class EntryPlan:
    """What a step's layers at one compression ratio share, each part made on first use: ids [E]
    the entry each compressed window of the step becomes (decode: one per sequence, -1 where its
    token closes no window), starts [E] their RoPE positions (each window's first), slots [E] their
    pool slots (-1: none); visible [T] the entries each query may see; every_visible_slots
    [T, max_context_len // ratio] the pool slots of HCA's choice (every visible entry, -1 after);
    :meth:`slots_of` the pool slots of chosen entries (CSA's). Slots are looked up in one
    :func:`entry_slot_table` of the step's block tables."""

    def __init__(self, plan: StepPlan, ratio: int):
        self.plan, self.ratio = plan, ratio

    @cached_property
    def _ids_and_owners(self) -> tuple[torch.Tensor, torch.Tensor]:
        meta, ratio = self.plan.meta, self.ratio
        device = meta.positions.device
        if self.plan.decode:  # a token closes its window at position % ratio == ratio - 1 (compress_decode_step's rule)
            visible = self.visible
            return torch.where(visible * ratio > meta.positions, visible - 1, -1), meta.seq_ids
        spans = [(length - (end - first), length) for first, end, length in meta.sequence_ranges()]
        ids = torch.cat([torch.arange(start // ratio, length // ratio, device=device) for start, length in spans])
        owners = torch.cat([torch.full((length // ratio - start // ratio,), b, device=device)
                            for b, (start, length) in enumerate(spans)])
        return ids, owners

    @cached_property
    def table(self) -> torch.Tensor:
        """``[B, max_context_len // ratio + 1]`` each sequence's entry slots (:func:`entry_slot_table`)."""
        meta = self.plan.meta
        return entry_slot_table(meta.block_tables, self.ratio, meta.max_context_len // self.ratio)

    def slots_of(self, entries: torch.Tensor) -> torch.Tensor:
        """Pool slots ``[T, k]`` of entry ids ``entries: [T, k]`` (-1: none -> -1) of each token's sequence."""
        return lookup_entries(self.table, self.plan.meta.seq_ids, entries)

    @cached_property
    def starts(self) -> torch.Tensor:
        return self._ids_and_owners[0].clamp_min(0) * self.ratio

    @cached_property
    def slots(self) -> torch.Tensor:
        ids, owners = self._ids_and_owners
        return lookup_entries(self.table, owners, ids[:, None])[:, 0]

    @cached_property
    def visible(self) -> torch.Tensor:
        return visible_entries(self.plan.meta.positions, self.ratio)

    @cached_property
    def visible_counts(self) -> torch.Tensor:
        """``visible`` as int32, as the kernels take it."""
        return self.visible.int()

    @cached_property
    def keys(self) -> KeyRanges:
        """The FP8 indexer's key ranges at this ratio: each sequence's entries, each query's visible ones."""
        meta = self.plan.meta
        return KeyRanges((meta.context_lens // self.ratio).int(), tuple(n // self.ratio for n in meta.context_lens_host),
                         self.visible_counts, meta.max_context_len // self.ratio, meta.query_lens, meta.block_tables,
                         paged_queries=1)

    @cached_property
    def every_visible_slots(self) -> torch.Tensor:
        count = self.plan.meta.max_context_len // self.ratio
        entry = torch.arange(count, device=self.visible.device)
        return torch.where(entry < self.visible[:, None], self.table[self.plan.meta.seq_ids, :count], -1)


def store_v4_rows(pool: torch.Tensor, rows: torch.Tensor, slots: torch.Tensor) -> None:
    """K=V rows ``[T, D]`` into a MODEL1 (uint8) or float pool at ``slots: [T]`` (< 0 skipped)."""
    if pool.dtype == torch.uint8:
        write_v4_cache(rows, pool, slots)
    else:
        store_rows(pool, rows, slots)


def paged_attention(attn: DeepseekV4Attention, x: torch.Tensor, plan: StepPlan, cache: V4LayerCache,
                    ropes: dict[str, RopeTable]) -> torch.Tensor:
    """One layer's attention over a step: ``x: [T, hidden]`` (normed) -> ``[T, hidden]``; writes
    the step's rows, entries and states into ``cache``."""
    positions = plan.meta.positions
    rope_at = ropes["compress" if attn.ratio else "main"](positions, fused=plan.production)
    attn.run_input_projections(x)  # before any fork: every branch takes its slices of these GEMMs
    if attn.ratio:
        plan.prepare_entries(attn.ratio)
    q_residual = attn.q_a_norm(attn.q_a_proj(x))
    # a captured step runs three chains beside the query and window path: the compressor's, the
    # indexer's keys, and the indexer's queries, which join the keys before scoring them
    entries, keys, choice = branch(x, 0), branch(x, 1), branch(x, 2)
    picked = lengths = None
    if attn.ratio:
        with entries.run():
            compress(attn.compressor, x, plan, cache.entries, cache.state, ropes["compress"])
    if attn.layer_type == CSA:
        indexer = attn.compressor.indexer
        with keys.run():
            compress(indexer, x, plan, cache.index, cache.index_state, ropes["compress"])
        with choice.run():
            index_q, weights = indexer.queries(x, q_residual, rope_at)
            keys.join()  # this step's closed window is in the pool
            picked = select_entries(indexer, index_q, weights, plan, cache.index)
    q, kv = attn.query_and_kv(x, q_residual, rope_at)
    window = plan.window_pool(cache.window, kv)
    for side in (entries, keys, choice):
        side.join()
    main = None
    if picked is not None:  # CSA: the indexer's choice
        main = (cache.entries, plan.entries(attn.ratio).slots_of(picked))
    elif attn.ratio and plan.meta.max_context_len >= attn.ratio:  # HCA: every visible entry, in order
        shared = plan.entries(attn.ratio)
        main = (cache.entries, shared.every_visible_slots)
        lengths = shared.visible_counts  # in a decode step the kernel stops at the visible count
    out = attend(q, window, plan.window_rows if plan.production else plan.window, main, attn.sinks,
                 attn.head_dim**-0.5, plan, lengths)
    plan.store_window(cache.window, kv)
    return attn.output(out, rope_at)


def attend(q: torch.Tensor, window: torch.Tensor, window_rows: torch.Tensor, main: tuple | None, sinks: torch.Tensor,
           scale: float, plan: StepPlan, lengths: torch.Tensor | None = None) -> torch.Tensor:
    """Sinked attention of ``q: [T, H, D]`` over its window rows and the ``main = (pool, slots [T, K])``
    compressed entries, if any (``lengths: [T]``: the first that count, or None: all) -> ``[T, H, D]``.
    Production decode steps run as B requests of one query (the kernel splits each request's
    keys), other steps as one request of T queries."""
    if not plan.production:
        entries = None if main is None else main[0].view(-1, main[0].shape[-1])
        return sparse_sink_attention(q, window, window_rows, sinks, scale, entries, None if main is None else main[1])
    sets = [(window, window_rows)] if main is None else [main, (window, window_rows)]
    (pool, rows), (extra, extra_rows) = sets[0], (sets[1] if len(sets) > 1 else (None, None))
    shape = (q.shape[0], 1) if plan.decode else (1, q.shape[0])  # (requests, queries each)
    out, _ = sparse_attention_v4_decode(
        q.view(*shape, *q.shape[1:]), pool, rows.view(*shape, -1).int(), scale,
        topk_length=lengths if plan.decode and main is not None else None, attn_sink=sinks, extra_kv_cache=extra,
        extra_indices=None if extra_rows is None else extra_rows.view(*shape, -1).int())
    return out.view(q.shape)


def compress(module: Compressor, x: torch.Tensor, plan: StepPlan, pool: torch.Tensor,
             state: tuple[torch.Tensor, torch.Tensor], rope: RopeTable) -> None:
    """Feed the step's tokens to ``module``'s per-sequence states and write the entries of the
    windows they close into ``pool`` (module docstring)."""
    meta, shared = plan.meta, plan.entries(module.ratio)
    kv, gate = module.kv_proj(x), module.gate_proj(x)
    fresh = plan.fresh
    if plan.decode:  # in place on the state pool; which windows close is the step's (EntryPlan)
        pooled, _ = compress_decode_step(kv, gate, meta.positions, module.position_bias, module.overlap, *state,
                                         state_slots=plan.slots, fresh=fresh, out_dtype=x.dtype)
    else:
        state_kv = torch.where(fresh[:, None, None], 0.0, state[0][plan.slots])
        state_score = torch.where(fresh[:, None, None], float("-inf"), state[1][plan.slots])
        pooled = torch.cat([
            compress_sequence(kv[first:end], gate[first:end], module.position_bias, module.overlap,
                              start_pos=length - (end - first), state_kv=state_kv[b], state_score=state_score[b])[0]
            for b, (first, end, length) in enumerate(meta.sequence_ranges())])
        state[0][plan.slots], state[1][plan.slots] = state_kv, state_score
    pooled = pooled.to(x.dtype)  # a decode step's entries come in x's dtype already (no kernel)
    entries = rope(shared.starts, fused=plan.production).rotate_tail(module.kv_norm(pooled))
    (store_index_key if isinstance(module, Indexer) else store_v4_rows)(pool, entries, shared.slots)


def select_entries(indexer: Indexer, q: torch.Tensor, weights: torch.Tensor, plan: StepPlan,
                   pool: torch.Tensor) -> torch.Tensor:
    """CSA top-k: ``[T, index_topk]`` entry ids by the lightning indexer, -1 padded, for its queries
    ``q, weights = indexer.queries(...)`` (RoPE'd with the layer's own, compressed, RoPE)."""
    meta, ratio, k = plan.meta, indexer.ratio, indexer.topk
    visible = plan.entries(ratio).visible
    if pool.dtype == torch.uint8:
        keys = plan.entries(ratio).keys
        return indexer.choice(fp8_select(q, weights * indexer.head_dim**-0.5, pool, keys, TopK(k)).long())
    out = torch.full((q.shape[0], k), -1, dtype=torch.int64, device=q.device)
    for b, (first, end, length) in enumerate(meta.sequence_ranges()):
        keys = gather_rows(pool, meta.block_tables[b], length // ratio)
        picked = select_topk(indexer.score(q[first:end], keys, weights[first:end]), visible[first:end], k)
        out[first:end, :picked.shape[1]] = picked
    return indexer.choice(out)
